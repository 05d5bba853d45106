"""Q(w): the pre-caching degree of SAE latents in a pretrained LM, by ablation (docs/paper.md#q, #gemma).

For a latent w and one of its top-activating contexts with max-activating position p:

* ablate w at position p only (``reconstruction``: replace the activation by the SAE decoding of its code with w
  zeroed, the reference's choice; ``error-preserving``: subtract only w's own decoder contribution);
* ``d_m = KL(clean || ablated)`` of the predictive distributions at positions ``p + m - 1``, ``m = 1 .. H``
  (H = 10: the predictions of tokens p+1 .. p+10);
* ``ratio = sum_{m >= 2} d_m / (d_1 + 1e-8)``; Q(w) is the mean of the ratio over the examples;
* latents whose mean total KL ``sum_m d_m`` is at most 0.05 are excluded.

Examples come from scanning a corpus with the SAE (:func:`top_activations`): per latent and context, the position of
the largest activation (BOS excluded); the contexts with the largest such activations are kept, zero activations are
dropped, near-duplicates (token edit distance <= 10 between the windows ending at p + 10, in order of decreasing
activation) are removed, then examples without H future positions are skipped - the reference's order.

:func:`ablation_kl` is the batched computation: one clean forward per context (its logits and site activations
reused by every (latent, example) pair on it) and many pairs per ablated forward, each row truncated to p + H.
:func:`reference_loop_kl` re-implements the reference's loop (one example, two forwards at a time) for tests and
benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, overload

import numpy as np
import torch

from ntpflow.llm.corpus import DOMAINS, Contexts
from ntpflow.llm.sae import as_sae
from ntpflow.progress import progress_of
from ntpflow.stats import sigma_ci

MODES = ("reconstruction", "error-preserving")
EPS = 1e-8


# --------------------------------------------------------------------------------------------- top activations


@dataclass
class TopActivations:
    """Per latent, the contexts where it is most active.

    Attributes:
        latents: ``[S]`` latent ids (columns of the other tensors).
        values: ``[K, S]`` max activation of the latent in the context, descending; ``-inf`` where unfilled.
        contexts: ``[K, S]`` context row index (-1 where unfilled).
        positions: ``[K, S]`` position of that max within the context.
    """

    latents: torch.Tensor
    values: torch.Tensor
    contexts: torch.Tensor
    positions: torch.Tensor


@torch.no_grad()
def top_activations(adapter: Any, sae: Any, tokens: torch.Tensor, hook: str, latents: Sequence[int] | None = None,
                    k: int = 32, batch_size: int = 16, min_position: int = 1) -> TopActivations:
    """Scan ``tokens`` ``[N, L]`` with the SAE at ``hook`` and keep, per latent, the ``k`` contexts with the largest
    max activation (over positions ``>= min_position``; position 0 is BOS).

    Args:
        adapter: a :class:`~ntpflow.llm.adapters.ModelAdapter`.
        sae: an SAE (see :func:`~ntpflow.llm.sae.as_sae`).
        tokens: ``[N, L]`` int64.
        hook: the site.
        latents: latent ids to keep (default: all).
        k: contexts kept per latent.
        batch_size: contexts per forward.
        min_position: first position considered.
    """
    h = as_sae(sae)
    adapter.check_hook(hook)
    h.check_width(adapter.d_model, hook)
    lat = torch.arange(h.d_sae) if latents is None else torch.as_tensor(list(latents), dtype=torch.long)
    _check_latents(lat, h.d_sae)
    S = lat.numel()
    vals = torch.full((0, S), -math.inf)
    ctx = torch.full((0, S), -1, dtype=torch.long)
    pos = torch.full((0, S), -1, dtype=torch.long)
    for i in range(0, tokens.shape[0], batch_size):
        acts = adapter.activations(tokens[i:i + batch_size], hook)[:, min_position:]  # [B, L', d]
        f = h.encode(acts)[..., lat.to(acts.device)].float().cpu()  # [B, L', S]
        bv, bp = f.max(dim=1)  # [B, S]
        B = bv.shape[0]
        vals = torch.cat([vals, bv])
        ctx = torch.cat([ctx, torch.arange(i, i + B)[:, None].expand(B, S)])
        pos = torch.cat([pos, bp + min_position])
        if vals.shape[0] > k:
            vals, idx = vals.topk(k, dim=0)
            ctx, pos = ctx.gather(0, idx), pos.gather(0, idx)
    vals, idx = vals.sort(dim=0, descending=True)
    return TopActivations(lat, vals, ctx.gather(0, idx), pos.gather(0, idx))


def edit_distance_at_most(a: Sequence[int], b: Sequence[int], bound: int) -> bool:
    """Whether the Levenshtein distance between token lists ``a`` and ``b`` is ``<= bound`` (vectorised rows, early
    exit once every entry of a row exceeds ``bound``)."""
    if abs(len(a) - len(b)) > bound:
        return False
    bb = np.asarray(b, dtype=np.int64)
    ar = np.arange(len(bb) + 1)
    prev = ar.copy()
    for i, x in enumerate(a, start=1):
        tmp = np.empty_like(prev)
        tmp[0] = i
        tmp[1:] = np.minimum(prev[1:] + 1, prev[:-1] + (bb != x))
        cur = np.minimum.accumulate(tmp - ar) + ar  # insertions: cur[j] = min_k<=j tmp[k] + (j - k)
        if cur.min() > bound:
            return False
        prev = cur
    return int(prev[-1]) <= bound


@dataclass
class Example:
    """One (context, position) example of a latent."""

    context: int
    position: int
    activation: float


def select_examples(top: TopActivations, tokens: torch.Tensor, n_examples: int = 8, horizon: int = 10,
                    dedup_distance: int = 10) -> dict[int, list[Example]]:
    """Per latent: drop zero activations, remove near-duplicates (edit distance ``<= dedup_distance`` between the
    token windows ``[1, p + horizon]`` to an already kept, more active example), skip examples without ``horizon``
    future positions, keep the first ``n_examples``."""
    L = tokens.shape[1]
    tok = tokens.tolist()
    out: dict[int, list[Example]] = {}
    for s, latent in enumerate(top.latents.tolist()):
        kept: list[tuple[Example, list[int]]] = []
        for v, c, p in zip(top.values[:, s].tolist(), top.contexts[:, s].tolist(), top.positions[:, s].tolist()):
            if c < 0 or not v > 0:
                continue
            window = tok[c][1:p + horizon + 1]
            if dedup_distance >= 0 and any(edit_distance_at_most(window, w, dedup_distance) for _, w in kept):
                continue
            kept.append((Example(c, p, float(v)), window))
        usable = [e for e, _ in kept if e.position + horizon <= L]
        out[latent] = usable[:n_examples]
    return out


# ------------------------------------------------------------------------------------------------- ablation KL


def _check_latents(lat: torch.Tensor, d_sae: int) -> None:
    if lat.numel() and (int(lat.min()) < 0 or int(lat.max()) >= d_sae):
        raise ValueError(f"latent ids must lie in [0, {d_sae}), got min {int(lat.min())} max {int(lat.max())}")


def _check_pairs(adapter: Any, h: Any, tokens: torch.Tensor, hook: str, latents: torch.Tensor,
                 contexts: torch.Tensor, positions: torch.Tensor, horizon: int, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    adapter.check_hook(hook)
    h.check_width(adapter.d_model, hook)
    if not (latents.shape == contexts.shape == positions.shape) or latents.dim() != 1:
        raise ValueError("latents, contexts and positions must be 1-d and of equal length")
    _check_latents(latents, h.d_sae)
    if contexts.numel() and (int(contexts.min()) < 0 or int(contexts.max()) >= tokens.shape[0]):
        raise ValueError(f"context index out of range [0, {tokens.shape[0]})")
    if positions.numel():
        if int(positions.min()) < 0:
            raise ValueError("positions must be >= 0")
        worst = int(positions.max())
        if worst + horizon > tokens.shape[1]:
            raise ValueError(f"context too short: ablation at position p={worst} needs predictions at p..p+"
                             f"{horizon - 1}, i.e. length >= p+{horizon} = {worst + horizon}, but contexts have "
                             f"length {tokens.shape[1]}")


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _kl(clean_logits: torch.Tensor, abl_logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(clean) || softmax(abl))`` over the last axis, in float32 or wider. ``[..., V] -> [...]``."""
    dt = _wide(clean_logits)
    lc = torch.log_softmax(clean_logits.to(dt), dim=-1)
    la = torch.log_softmax(abl_logits.to(dt), dim=-1)
    return (lc.exp() * (lc - la)).sum(-1)


@torch.no_grad()
@overload
def ablation_kl(adapter: Any, sae: Any, tokens: torch.Tensor, hook: str, latents: torch.Tensor,
                contexts: torch.Tensor, positions: torch.Tensor, mode: str = "reconstruction",
                horizon: int = 10, contexts_per_batch: int = 16, pairs_per_batch: int = 32, use_prefix_cache: bool = True,
                progress: bool = False) -> torch.Tensor: ...
@overload
def ablation_kl(adapter: Any, sae: Any, tokens: torch.Tensor, hook: str, latents: torch.Tensor,
                contexts: torch.Tensor, positions: torch.Tensor, mode: Sequence[str] = ...,
                horizon: int = 10, contexts_per_batch: int = 16, pairs_per_batch: int = 32, use_prefix_cache: bool = True,
                progress: bool = False) -> dict[str, torch.Tensor]: ...
def ablation_kl(adapter: Any, sae: Any, tokens: torch.Tensor, hook: str, latents: torch.Tensor,
                contexts: torch.Tensor, positions: torch.Tensor, mode: str | Sequence[str] = "reconstruction",
                horizon: int = 10, contexts_per_batch: int = 16, pairs_per_batch: int = 32, use_prefix_cache: bool = True,
                progress: bool = False) -> torch.Tensor | dict[str, torch.Tensor]:
    """Batched ``d_m`` for many (latent, context, position) pairs.

    Args:
        adapter: a :class:`~ntpflow.llm.adapters.ModelAdapter`.
        sae: an SAE (see :func:`~ntpflow.llm.sae.as_sae`).
        tokens: ``[N, L]`` int64 contexts.
        hook: the site the SAE reads.
        latents, contexts, positions: ``[P]`` int64 each; pair i ablates latent ``latents[i]`` at position
            ``positions[i]`` of context ``tokens[contexts[i]]``.
        mode: ``"reconstruction"`` or ``"error-preserving"`` (see :meth:`~ntpflow.llm.sae.SAEHandle.ablated`), or
            a sequence of modes, computed together (the clean runs shared).
        horizon: H, the number of predictions scored.
        contexts_per_batch: contexts per clean forward.
        pairs_per_batch: pairs per ablated forward.
        use_prefix_cache: when the adapter supports it (:class:`~ntpflow.llm.adapters.HFAdapter`), ablated rows
            reuse the clean run's keys/values for positions < p and compute only positions p .. p+H-1 (exact: the
            ablation cannot change earlier positions), and, where the model allows it, only the layers above the
            site, starting from the clean site activations. Otherwise each ablated row is a full forward up to p+H.
        progress: a bar over the batches of contexts (stage lines on stderr without a terminal).

    Returns:
        ``[P, H]`` float64: ``d[i, m-1] = KL(clean || ablated)`` of the prediction at position
        ``positions[i] + m - 1``; for a sequence of modes, a dict ``{mode: [P, H]}``. In ``error-preserving`` mode
        a latent inactive at ``p`` changes nothing: its row is exactly 0 and costs no forward.
    """
    h = as_sae(sae)
    latents, contexts, positions = (torch.as_tensor(x, dtype=torch.long).reshape(-1)
                                    for x in (latents, contexts, positions))
    modes = [mode] if isinstance(mode, str) else list(mode)
    for m in modes:
        _check_pairs(adapter, h, tokens, hook, latents, contexts, positions, horizon, m)
    P = latents.numel()
    out = {m: torch.zeros(P, horizon, dtype=torch.float64) for m in modes}
    uniq = torch.unique(contexts)
    for ci in progress_of(range(0, uniq.numel(), contexts_per_batch), desc="Q scan ablations", unit="context batch",
                          enabled=progress):
        chunk = uniq[ci:ci + contexts_per_batch]
        sel = torch.nonzero(torch.isin(contexts, chunk)).flatten()
        T = int(positions[sel].max()) + horizon
        prefix = getattr(adapter, "supports_prefix_cache", False) and use_prefix_cache
        if prefix:  # per layer (keys, values) [B, h, T, d_head] of the clean run, reused by the ablated rows
            clean_logits, acts, kv = adapter.clean_with_cache(tokens[chunk, :T], hook)
        else:
            clean_logits, acts = adapter.logits_and_activations(tokens[chunk, :T], hook)  # [B, T, V], [B, T, d]
        row_of = torch.full((int(chunk.max()) + 1,), -1, dtype=torch.long)
        row_of[chunk] = torch.arange(chunk.numel())
        rows = row_of[contexts[sel]]
        x = acts[rows.to(acts.device), positions[sel].to(acts.device)]  # [n, d]
        lat_sel = latents[sel].to(x.device)
        active = (h.encode(x)[torch.arange(x.shape[0], device=x.device), lat_sel] != 0).cpu()  # [n]
        for m in modes:
            # error-preserving: an inactive latent contributes nothing, so its ablation changes nothing and its
            # d stays exactly 0 without a forward (a forward would give rounding residues of ~1e-16 instead)
            keep = active if m == "error-preserving" else torch.ones_like(active)
            new = h.ablated(x, lat_sel, m)  # [n, d]
            kept = torch.nonzero(keep).flatten()
            order = kept[torch.argsort(positions[sel][kept], stable=True)]  # similar lengths together
            for j in range(0, order.numel(), pairs_per_batch):
                o = order[j:j + pairs_per_batch]
                out[m][sel[o]] = _ablated_batch_kl(adapter, tokens, hook, contexts[sel[o]], rows[o],
                                                   positions[sel][o], new[o.to(new.device)], clean_logits, acts,
                                                   kv if prefix else None, horizon)
    return out[mode] if isinstance(mode, str) else out


def _ablated_batch_kl(adapter: Any, tokens: torch.Tensor, hook: str, ctx: torch.Tensor, r: torch.Tensor,
                      p: torch.Tensor, vecs: torch.Tensor, clean_logits: torch.Tensor, acts: torch.Tensor,
                      kv: list | None, horizon: int) -> torch.Tensor:
    """``[b, H]`` KL of ``b`` pairs: context ``ctx`` (row ``r`` of the clean run's ``clean_logits`` ``[B, T, V]``
    and ``acts`` ``[B, T, d]``), activation at position ``p`` replaced by ``vecs`` ``[b, d]``; ``kv`` is the clean
    run's per-layer key/value cache (prefix-cache path) or None (full ablated forwards)."""
    b = ctx.numel()
    dev = acts.device
    p_dev, r_dev = p.to(dev), r.to(dev)
    tpos = (p[:, None] + torch.arange(horizon)[None]).to(dev)  # [b, H]
    c = clean_logits[r_dev[:, None], tpos]  # [b, H, V]
    if kv is not None:
        Tp = int(p.max())
        sub_kv = [(k[r_dev, :, :Tp], v[r_dev, :, :Tp]) for k, v in kv]
        suffix = tokens[ctx[:, None], tpos.cpu()]  # [b, H]
        resid = acts[r_dev[:, None], tpos]  # [b, H, d] clean site activations of the suffix

        def edit(act: torch.Tensor) -> torch.Tensor:
            act = act.clone()
            act[:, 0] = vecs.to(act.dtype)  # suffix position 0 is p
            return act

        a = adapter.logits_after_prefix(sub_kv, p_dev, suffix, hook=hook, edit=edit, resid=resid)  # [b, H, V]
    else:
        ar = torch.arange(b, device=dev)

        def edit(act: torch.Tensor) -> torch.Tensor:
            act = act.clone()
            act[ar, p_dev] = vecs.to(act.dtype)
            return act

        abl = adapter.logits(tokens[ctx, :int(p.max()) + horizon], hook=hook, edit=edit)  # [b, Tb, V]
        a = abl[ar[:, None], tpos]  # [b, H, V]
    return _kl(c, a).double().cpu()


@torch.no_grad()
def reference_loop_kl(adapter: Any, sae: Any, tokens: torch.Tensor, hook: str, latents: torch.Tensor,
                      contexts: torch.Tensor, positions: torch.Tensor, mode: str = "reconstruction",
                      horizon: int = 10, decode_token: Any = None) -> torch.Tensor:
    """The reference's loop, re-implemented: per example, a clean forward and an ablated forward at batch size 1 on
    the context truncated after position ``p + horizon`` (the reference keeps one token past the last scored
    prediction), the SAE applied inside the hook to the activation at ``p``; per scored position the KL plus, as
    the reference does, the argmax tokens (decoded with ``decode_token(id)`` if given) and the top-3 probability
    changes. Same inputs and output (``[P, H]`` float64) as :func:`ablation_kl`."""
    h = as_sae(sae)
    latents, contexts, positions = (torch.as_tensor(x, dtype=torch.long).reshape(-1)
                                    for x in (latents, contexts, positions))
    _check_pairs(adapter, h, tokens, hook, latents, contexts, positions, horizon, mode)
    out = torch.zeros(latents.numel(), horizon, dtype=torch.float64)
    for i, (f, c, p) in enumerate(zip(latents.tolist(), contexts.tolist(), positions.tolist())):
        seq = tokens[c:c + 1, :p + horizon + 1]
        base = adapter.logits(seq)[0, p:p + horizon]

        def edit(act: torch.Tensor, p: int = p, f: int = f) -> torch.Tensor:
            act = act.clone()
            act[0, p] = h.ablated(act[0, p][None], torch.tensor([f], device=act.device), mode)[0]
            return act

        abl = adapter.logits(seq, hook=hook, edit=edit)[0, p:p + horizon]
        dt = _wide(base)
        for m in range(horizon):
            bp = torch.softmax(base[m].to(dt), -1)
            ap = torch.softmax(abl[m].to(dt), -1)
            la = torch.log_softmax(abl[m].to(dt), -1)
            out[i, m] = float(torch.nn.functional.kl_div(la, bp, reduction="sum"))
            if decode_token is not None:
                decode_token(int(base[m].argmax()))
                decode_token(int(abl[m].argmax()))
            diff = ap - bp
            torch.topk(diff, 3)
            torch.topk(-diff, 3)
    return out


def q_from_kl(d: torch.Tensor) -> tuple[float, float]:
    """``(Q, mean total KL)`` from ``d`` ``[n_examples, H]``: Q is the mean over examples of
    ``sum_{m>=2} d_m / (d_1 + 1e-8)``; NaN without examples (both) or with ``H < 2`` (Q)."""
    d = torch.as_tensor(d, dtype=torch.float64)
    if d.shape[0] == 0:
        return math.nan, math.nan
    total = float(d.sum(1).mean())
    if d.shape[1] < 2:
        return math.nan, total
    return float((d[:, 1:].sum(1) / (d[:, 0] + EPS)).mean()), total


# ------------------------------------------------------------------------------------------------------ the scan


@dataclass
class QScanConfig:
    """Settings of :func:`q_scan`.

    Attributes:
        n_candidates: top contexts kept per latent before de-duplication.
        n_examples: examples per latent after de-duplication.
        horizon: H (the reference: 10).
        dedup_distance: near-duplicate edit-distance bound (the reference: 10; -1 disables).
        kl_cutoff: latents with mean total KL ``<=`` this are excluded (the reference: 0.05).
        modes: ablation modes to run.
        scan_batch_size: contexts per forward when scanning.
        contexts_per_batch: contexts per clean forward.
        pairs_per_batch: pairs per ablated forward.
    """

    n_candidates: int = 24
    n_examples: int = 8
    horizon: int = 10
    dedup_distance: int = 10
    kl_cutoff: float = 0.05
    modes: tuple[str, ...] = ("reconstruction", "error-preserving")
    scan_batch_size: int = 16
    contexts_per_batch: int = 16
    pairs_per_batch: int = 32


@dataclass
class QScanResult:
    """Q(w) for a set of latents under one ablation mode.

    Attributes:
        mode: the ablation mode.
        latents: latent ids, ``[S]``.
        q: Q per latent (NaN without examples).
        total_kl: mean total KL per latent.
        n_examples: examples used per latent.
        included: ``total_kl > kl_cutoff`` (and at least one example).
        d_mean: mean ``d_m`` profile per latent, ``[S][H]``.
        domain_share: share of the latent's examples in each of ``domains``, ``[S][len(domains)]``.
        domain: the domain with the largest share per latent.
        is_formal: whether the formal domains (code + math, or the user's) hold more than half of its examples.
        kl_cutoff: the cutoff used.
        extra: ``{"hook": the site scanned}`` (empty in results saved before it was recorded).
        domains: the corpus's domains (:attr:`~ntpflow.llm.corpus.Contexts.domain_names`; default
            :data:`~ntpflow.llm.corpus.DOMAINS`, for results saved before they were stored).
    """

    mode: str
    latents: list[int]
    q: list[float]
    total_kl: list[float]
    n_examples: list[int]
    included: list[bool]
    d_mean: list[list[float]]
    domain_share: list[list[float]]
    domain: list[str]
    is_formal: list[bool]
    kl_cutoff: float
    extra: dict = field(default_factory=dict)
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))

    def to_dict(self) -> dict:
        return asdict(self)

    def included_q(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """``(q, is_formal, domain)`` of the included latents."""
        m = np.asarray(self.included, dtype=bool)
        return (np.asarray(self.q)[m], np.asarray(self.is_formal)[m],
                [d for d, k in zip(self.domain, self.included) if k])


def q_scan(adapter: Any, sae: Any, contexts: Contexts, hook: str, latents: Sequence[int] | None = None,
           cfg: QScanConfig | None = None, progress: bool = False) -> dict[str, QScanResult]:
    """Full Q scan: top activations, de-duplication, batched ablation KL in each mode, Q, the KL filter and a
    domain label per latent.

    Args:
        adapter: a :class:`~ntpflow.llm.adapters.ModelAdapter`.
        sae: an SAE at ``hook``.
        contexts: the corpus windows (:class:`~ntpflow.llm.corpus.Contexts`).
        hook: the site.
        latents: latent ids to score (default: all).
        cfg: settings.
        progress: as in :func:`ablation_kl`.

    Returns:
        ``{mode: QScanResult}``.
    """
    cfg = cfg or QScanConfig()
    for m in cfg.modes:
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {m!r}")
    tokens = contexts.tokens
    top = top_activations(adapter, sae, tokens, hook, latents, k=cfg.n_candidates,
                          batch_size=cfg.scan_batch_size)
    ex = select_examples(top, tokens, cfg.n_examples, cfg.horizon, cfg.dedup_distance)
    lat_list = top.latents.tolist()
    pl, pc, pp, owner = [], [], [], []
    for s, latent in enumerate(lat_list):
        for e in ex[latent]:
            pl.append(latent)
            pc.append(e.context)
            pp.append(e.position)
            owner.append(s)
    dom = contexts.domain_ids()
    assert contexts.domain_names is not None and contexts.formal is not None  # set by Contexts.__post_init__
    names = list(contexts.domain_names)
    share = torch.zeros(len(lat_list), len(names))
    owner_t = torch.tensor(owner, dtype=torch.long)
    if owner:
        share.index_put_((owner_t, dom[torch.tensor(pc)]), torch.ones(len(owner)), accumulate=True)
    counts = torch.bincount(owner_t, minlength=len(lat_list)) if owner else torch.zeros(len(lat_list))
    share = share / counts.clamp(min=1)[:, None]
    formal = share[:, [names.index(d) for d in contexts.formal]].sum(1) > 0.5
    results = {}
    modes = list(cfg.modes)
    d_all = ablation_kl(adapter, sae, tokens, hook, torch.tensor(pl, dtype=torch.long),
                        torch.tensor(pc, dtype=torch.long), torch.tensor(pp, dtype=torch.long), mode=modes,
                        horizon=cfg.horizon, contexts_per_batch=cfg.contexts_per_batch,
                        pairs_per_batch=cfg.pairs_per_batch, progress=progress) if pl else {m: torch.zeros(0, cfg.horizon) for m in modes}
    for mode in modes:
        d = d_all[mode]
        q, tot, dm = [], [], []
        for s in range(len(lat_list)):
            rows = d[owner_t == s] if owner else d[:0]
            qs, ts = q_from_kl(rows)
            q.append(qs)
            tot.append(ts)
            dm.append(rows.mean(0).tolist() if rows.shape[0] else [math.nan] * cfg.horizon)
        n_ex = counts.long().tolist()
        results[mode] = QScanResult(
            mode=mode, latents=lat_list, q=q, total_kl=tot, n_examples=n_ex,
            included=[n > 0 and t > cfg.kl_cutoff for n, t in zip(n_ex, tot)], d_mean=dm,
            domain_share=share.tolist(), domain=[names[int(i)] for i in share.argmax(1)],
            is_formal=formal.tolist(), kl_cutoff=cfg.kl_cutoff, extra={"hook": hook}, domains=names)
    return results


# ------------------------------------------------------------------------------------------------------ statistics


def q_statistics(result: QScanResult, tail: float = 0.1) -> dict:
    """The paper's statistics on the included latents: sigma(ln Q) with 95% CIs for formal (code/math, or the
    user's formal domains) and other latents, and the domain make-up of the lowest and highest ``tail`` share of Q."""
    q, formal, doms = result.included_q()
    ok = q > 0
    lq, formal, doms = np.log(q[ok]), formal[ok], [d for d, k in zip(doms, ok) if k]
    out: dict = {"mode": result.mode, "n_scored": len(result.latents), "n_included": len(q),
                 "n_positive_q": int(ok.sum())}
    for name, m in (("formal", formal), ("other", ~formal)):
        mid, half = sigma_ci(lq[m])
        out[f"sigma_lnq_{name}"] = {"sigma": mid, "ci_half": half, "n": int(m.sum())}
    order = np.argsort(lq)
    n_tail = max(1, round(tail * len(lq))) if len(lq) else 0
    for name, idx in (("low_tail", order[:n_tail]), ("high_tail", order[len(order) - n_tail:])):
        out[name] = {d: (sum(doms[i] == d for i in idx) / max(1, len(idx))) for d in result.domains}
    out["all"] = {d: (sum(x == d for x in doms) / max(1, len(doms))) for d in result.domains}
    if len(lq):
        out["median_q"] = float(np.exp(np.median(lq)))
    return out
