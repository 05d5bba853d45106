"""Per-step influence of each gradient component on probed features (paper Def. 3.2–3.3, Sec. 3.4).

A feature is a probe direction w at a site ⟨k, i⟩. Its mismatch on a batch is

    R = mean_b (⟨w, r^k_i(θ)⟩ − ⟨w, r^k_i(θ*)⟩)²

with θ* the final model and r(θ) from the ordinary (non-myopic) forward, even in a myopic run. Next to this
``paper`` mismatch the tracker integrates the **centred** mismatch

    R_c = var_b (⟨w, r^k_i(θ)⟩ − ⟨w, r^k_i(θ*)⟩) = R − (mean_b (⟨w, r(θ)⟩ − ⟨w, r(θ*)⟩))²

which drops the offset of the mean projection and measures only how well the feature *varies* like the final
one (its gradient has the per-example cotangent 2(d_b − d̄)/n, so it comes from the same passes). The influence of a
component c at a step is ``∇θR · Δ_c``, where Δ_c is that component's share of the parameter update *as it is
subtracted* (θ ← θ − Σ_c Δ_c). **Positive influence means the component moved the feature toward its final value.**

- SGD variant: Δ_c = lr · g_c (rows ``optimizer="sgd"``: the SGD direction, in any run).
- Adam variant (reference, rows ``"adam"``): one first moment per site and component, the optimizer's second
  moment shared, so Δ_direct + Δ_pre_cached + Δ_shared equals the real Adam step. Every component is multiplied by
  the full gradient's per-parameter scale lr/(√v̂+ε): where the components' gradients cancel that scale is large,
  and the split can be ill-conditioned (κ ≫ 1, ``ntpflow.replay.conditioning``).
- SGD with momentum μ (rows ``"momentum"``): one momentum buffer per site and component, m_c ← μ m_c + g_c, and
  Δ_c = lr · m_c; the step is linear in the gradients, so the split is the step's own, with no scale to amplify it.
"""

import copy
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ntpflow.engine.decomposition import SitePasses, flat_grads
from ntpflow.engine.forward_mode import Primals, all_tangents, site_tangents
from ntpflow.model.gpt import GPT, GPTConfig
from ntpflow.model.shapes import Labels, Mask, Rows, Tokens
from ntpflow.model.sites import Site, checked_sites

COMPONENTS = ("direct", "pre_cached", "shared", "full")
MISMATCHES = ("paper", "centred")  # R = mean_b d_b², and R_c = mean_b (d_b − d̄)²


def mismatch_value(d: torch.Tensor, mismatch: str) -> torch.Tensor:
    """R (``"paper"``: mean_b d_b²) or R_c (``"centred"``: mean_b (d_b − d̄)²) of projection differences d [batch,
    ...]: a mean over the batch (dim 0), one value per trailing index."""
    return d.pow(2).mean(0) if mismatch == "paper" else (d - d.mean(0)).pow(2).mean(0)


@dataclass(frozen=True)
class Probe:
    """A feature direction ``w`` [d_model] read at ``site``; ``name`` labels the feature."""

    site: Site
    name: str
    w: torch.Tensor


def plain_sgd(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` steps as ``torch.optim.SGD`` does: SGD itself, or a subclass that only sets the learning rate
    between steps (``schedule_only``, as ``ntpflow.runs.training.ScheduledSGD``)."""
    return type(opt) is torch.optim.SGD or (isinstance(opt, torch.optim.SGD) and getattr(opt, "schedule_only", False))


def _check_optimizer(opt: torch.optim.Optimizer) -> tuple[str, dict]:
    if len(opt.param_groups) != 1:
        raise ValueError("influence tracking needs an optimizer with exactly one parameter group")
    g = opt.param_groups[0]
    if g.get("weight_decay", 0) != 0:
        raise ValueError("influence tracking needs weight_decay=0 (the component steps would not add up)")
    if g.get("maximize", False):
        raise ValueError("influence tracking needs maximize=False (a maximizing optimizer flips every sign)")
    if isinstance(opt, torch.optim.Adam) and not g.get("amsgrad", False):
        return "adam", g
    if plain_sgd(opt) and not g.get("nesterov", False) and g.get("dampening", 0) == 0:
        return ("momentum" if g.get("momentum", 0) else "sgd"), g
    raise ValueError(f"influence tracking supports Adam and SGD (with momentum, no dampening or Nesterov), not "
                     f"{type(opt).__name__} with these options")


def gauss_legendre(n: int) -> list[tuple[float, float]]:
    """The n-point Gauss–Legendre rule on [0, 1]: [(node s_j, weight ω_j)], Σ ω_j = 1; exact for polynomials of
    degree < 2n."""
    x, w = np.polynomial.legendre.leggauss(n)
    return [(float((xj + 1) / 2), float(wj / 2)) for xj, wj in zip(x, w)]


@dataclass(frozen=True)
class Readout:
    """A fixed readout set H: ``tokens`` [N, n_pos] (the sites' prefix), θ*'s projections on them ``final_proj``
    [N, n_probes], their type labels ``types`` ({probe name: int [N, pos]} or None), the Gauss–Legendre point
    counts tried in turn ``levels``, then the composite rules tried after the last level ``pieces`` (the step
    split into that many equal pieces, each with the last level's points), and the refinement tolerance
    (:meth:`tolerance`)."""

    tokens: torch.Tensor
    final_proj: torch.Tensor
    types: dict[str, torch.Tensor] | None
    levels: tuple[int, ...]
    rtol: float
    floor: float
    pieces: tuple[int, ...] = ()
    cap: float = 1e-3
    stall: float = 0.5

    def tolerance(self, change: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
        """A step's largest accepted |residual| per risk: min(``rtol`` · |change|, ``cap`` · |R_H(θ_0)|) +
        ``floor`` · |R_H(θ_0)|. Relative to the step's change, but never more than ``cap`` of the budget (a step that
        moves R_H by many times R_H(θ_0) and back must still not spend the row's 1 %); ``r0`` = |R_H(θ_0)|."""
        return torch.minimum(self.rtol * change.abs(), self.cap * r0) + self.floor * r0

    def excess(self, change: torch.Tensor, full: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
        """The worst risk's |residual| / tolerance over the last dimension (``full`` − ``change``, [..., n_risks]): 0
        when within, inf when the tolerance is 0 and the residual is not."""
        res, tol = (full - change).abs(), self.tolerance(change, r0)
        return torch.where(res <= tol, 0.0, res / tol).amax(-1)

    def settles(self, level: int, excess: float, previous: float) -> bool:
        """Whether a step integrated at ``rules[level]`` with worst ``excess`` (:meth:`excess`; ``previous`` at the
        rule before, inf at the first) is done: the last rule, every risk within its tolerance, or a split that did
        not cut the excess of the split before it by ``stall`` (the residual left is then not the rule's: typically
        the float32 rounding of the exact change, which more points do not reduce). The first split is compared with
        nothing: the whole step and its halves can both be short of Gauss's fast convergence (TinyStories myopic
        seed 2, step 18: worst excess 16 at 8 points, 11.7 at 2 × 8, within tolerance at 4 × 8)."""
        return (level + 1 == len(self.rules) or excess <= 1
                or (level > 0 and self.rules[level - 1][1] > 1 and excess > self.stall * previous))

    @property
    def rules(self) -> list[tuple[int, int]]:
        """The rules tried in turn, (points per piece, pieces): each level on the whole step, then the last level on
        each composite split."""
        return [(n, 1) for n in self.levels] + [(self.levels[-1], k) for k in self.pieces]


def composite_gauss_legendre(n: int, pieces: int) -> list[tuple[float, float]]:
    """The n-point Gauss–Legendre rule on each of ``pieces`` equal parts of [0, 1]: [(node, weight)], Σ weights = 1;
    for one piece exactly ``gauss_legendre(n)``."""
    if pieces == 1:
        return gauss_legendre(n)
    return [((j + s) / pieces, w / pieces) for j in range(pieces) for s, w in gauss_legendre(n)]


def _projection_dtype(device: torch.device) -> torch.dtype:
    """float64 for the probe projections, except on MPS (no float64 there)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


@dataclass(frozen=True)
class AdamStep:
    """One Adam step as the tracker sees it: the optimizer's second moment before it ``v_prev`` [n_params], its
    step number ``t`` (1 for the first), ``betas``, ``eps``, and the tracker's first moments, which the step updates
    in place: the full one ``m_full`` [n_params] and the sites' ``m_sites`` [n_sites, 2 (direct, pre-cached),
    n_params]."""

    v_prev: torch.Tensor
    t: int
    betas: tuple[float, float]
    eps: float
    m_full: torch.Tensor
    m_sites: torch.Tensor
    name = "adam"  # the optimizer column of its rows

    @property
    def beta1(self) -> float:
        return self.betas[0]

    def advance(self, m: torch.Tensor, g: torch.Tensor) -> None:
        """Update the first moment(s) ``m`` in place with the gradient(s) ``g``: β1·m + (1−β1)·g, rounded as Adam."""
        m.mul_(self.beta1).add_((1 - self.beta1) * g)

    def scale(self, lr: float, g_full: torch.Tensor) -> torch.Tensor:
        """The per-parameter step scale lr/(1−β1^t)/(sqrt(v̂)+eps) [n_params], v the second moment updated with
        this step's gradient ``g_full`` [n_params]: shared by every component (Adam's step is scale · m)."""
        beta1, beta2 = self.betas
        v = beta2 * self.v_prev + (1 - beta2) * g_full * g_full
        return lr / (1 - beta1**self.t) / ((v / (1 - beta2**self.t)).sqrt() + self.eps)


@dataclass(frozen=True)
class MomentumStep:
    """One step of SGD with momentum as the tracker sees it: the buffers m ← ``momentum`` · m + g (zero before the
    first step, so the first gives g, as torch's SGD without dampening) and the step lr · m; the tracker's buffers
    ``m_full`` [n_params] and ``m_sites`` [n_sites, 2 (direct, pre-cached), n_params] as in :class:`AdamStep`."""

    momentum: float
    m_full: torch.Tensor
    m_sites: torch.Tensor
    name = "momentum"

    def advance(self, m: torch.Tensor, g: torch.Tensor) -> None:
        """Update the buffer(s) ``m`` in place with the gradient(s) ``g``: momentum · m + g."""
        m.mul_(self.momentum).add_(g)

    def scale(self, lr: float, g_full: torch.Tensor) -> float:
        """The step scale: lr, the same for every parameter (the step is lr · m)."""
        return lr


def adam_second_moment(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], rows: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, int]:
    """The optimizer's second moment of ``params`` flat [n_params] (zero before the first step) and the number of
    the step about to be taken. ``rows``: for parameters stacked over a run axis ([R, ...]), the second moments of
    these runs, [len(rows), n_params per run]."""
    states = [opt.state.get(p, {}) for p in params]
    t = int(states[0]["step"]) + 1 if states[0] else 1
    if rows is None:
        return flat_grads([s.get("exp_avg_sq") for s in states], params), t
    v = [s["exp_avg_sq"][rows] if s else None for s in states]
    return flat_grads(v, [p[0] for p in params], batch=len(rows)), t


class InfluenceTracker:
    """Accumulates, before every optimizer step, the influence of each component on each probe.

    Call ``rows = tracker.track(model, opt, tokens, loss_mask, feature_types)`` *before* the training step (then
    ``tracker.optimizer_step(model, opt)`` takes that step on track's own gradient, bit for bit as
    ``training.train_step``). ``track`` does not change gradients, optimizer state or any RNG. Rows are tidy dicts:
    ``{step, layer, pos, feature, feature_type, mismatch, component, optimizer, value}``; ``feature_type`` is -1
    for the whole batch, else the type whose rows the risk was restricted to (empty subsets are skipped);
    ``mismatch`` is ``"paper"`` (R) or ``"centred"`` (R_c, the batch variance of the projection difference);
    ``component="risk"`` rows hold R or R_c itself (``optimizer="none"``). After ``use_readout`` (the exact account)
    every risk is read on a fixed readout set, each influence is a path integral along the step, and each risk has
    ``change`` (optimizer none) and ``residual`` rows.
    """

    def __init__(self, final_model: GPT | None, probes: Sequence[Probe], sgd_rows: bool = True,
                 bucket_width: int | None = None, bucket_elements: int = 2**25, midpoint: bool = False, *,
                 sites: Sequence[Site] = (), cfg: GPTConfig | None = None):
        """``sgd_rows=False`` drops the SGD rows of an Adam run. ``midpoint=True`` reads ∇R at the midpoint of the
        step actually taken, θ_t − Δ/2 (Δ the real Adam or SGD step), instead of at θ_t: the components then add up
        to the change of R along the step to second order, where at θ_t they do to first order only (see
        docs/balance.md); the components' update directions are the same in both. Sites of one layer are tracked
        together in buckets (one reverse-mode and one forward-mode call each, see ``buckets``): ``bucket_width`` is
        the widest spread of positions in a bucket of sites above the embedding (None: 1 on a CPU, where padding
        costs FLOPs, 4 elsewhere, where few large kernels win); ``bucket_elements`` caps rows × batch × positions ×
        d_model of a bucket's largest intermediate (memory). ``sites``: tracked besides the probes' own;
        ``final_model=None`` (``ntpflow.engine.exact``, which reads no θ*) takes the model's shape from ``cfg``."""
        self.bucket_width, self.bucket_elements = bucket_width, bucket_elements
        self._dataset: torch.Tensor | None = None  # see use_dataset
        self._last_grads: tuple | None = None  # (model, per-parameter gradients) of the last track(), see step
        self.final_model = final_model.eval() if final_model is not None else None
        shape = final_model.cfg if final_model is not None else cfg
        if shape is None:
            raise ValueError("the tracker needs the final model or the model's config")
        self.cfg: GPTConfig = shape
        self.probes = list(probes)
        self.sites = checked_sites([p.site for p in self.probes] + list(sites), self.cfg.n_layer, self.cfg.n_ctx)
        self.top_layer = max((s.layer for s in self.sites), default=0)  # the highest residual any reader reads
        d = self.cfg.d_model
        for p in self.probes:
            if p.w.shape != (d,):
                raise ValueError(f"probe {p.name} at {p.site} has shape {tuple(p.w.shape)}, expected ({d},)")
        self.directions = (torch.stack([p.w for p in self.probes]) if self.probes
                           else torch.empty(0, d))  # [n_probes, d_model], probe order
        self.sgd_rows, self.midpoint = sgd_rows, midpoint
        self._middle: GPT | None = None  # scratch weights θ_t − Δ/2 (midpoint mode)
        self.readout: Readout | None = None  # see use_readout
        self._points: list[GPT] = []  # scratch weights θ_t − s_j Δ (readout mode), one per node
        self._start: torch.Tensor | None = None  # R_H at the step's start [n_risks] (readout mode)
        self._r0: torch.Tensor | None = None  # |R_H(θ_0)| [n_risks]
        self.refined = self.evaluations = 0  # steps re-integrated, and points evaluated (readout mode)
        self.subdivided = 0  # steps settled at a composite rule (readout mode)
        # Adam first moments, stacked: per site [n_sites, 2 (direct, pre-cached), n_params], and the full one
        self._m_sites: torch.Tensor | None = None
        self._m_full: torch.Tensor | None = None
        self.step = 0

    def buckets(self, batch: int, device: torch.device) -> list[slice]:
        """Consecutive runs of ``self.sites`` (sorted by layer, then position) tracked in one call each.

        A bucket holds sites of one layer; for layer ≥ 1 (the keys and values of the site's own block, and any blocks
        below it, run over positions ≤ the bucket's last, so a shorter prefix is padded) their positions span less
        than the bucket width; every bucket keeps 4 rows per site × batch × positions × d_model within
        ``bucket_elements``.
        """
        width = self.bucket_width or (1 if torch.device(device).type == "cpu" else 4)
        d = self.cfg.d_model
        out, start = [], 0
        for j, s in enumerate(self.sites):
            first = self.sites[start]
            if j > start and (s.layer != first.layer or (s.layer >= 1 and s.pos - first.pos >= width)
                              or 4 * (j - start + 1) * batch * (s.pos + 1) * d > self.bucket_elements):
                out.append(slice(start, j))
                start = j
        return out + [slice(start, len(self.sites))]

    @property
    def final(self) -> GPT:
        """θ*, the final model (a tracker made without one, as ``ntpflow.engine.exact``'s, reads no θ*)."""
        if self.final_model is None:
            raise RuntimeError("this tracker has no final model")
        return self.final_model

    @property
    def exact_readout(self) -> Readout:
        """The exact account's readout set and rule (``use_readout``)."""
        if self.readout is None:
            raise RuntimeError("the exact account needs use_readout() first")
        return self.readout

    def moments(self, g_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first moments, the full one [n_params] and the sites' [n_sites, 2, n_params], allocated (zero) on first
        use like ``g_full``."""
        self._ensure_moments(g_full)
        assert self._m_full is not None and self._m_sites is not None
        return self._m_full, self._m_sites

    # ---- state for resuming ----
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state for resuming: the step and the first moments, ``m.full`` and ``m.{layer}:{pos}:{component}``
        (component direct or pre_cached), each [n_params]; none before the first Adam step."""
        state = {"step": torch.tensor(self.step)}
        if self._start is not None and self._r0 is not None:
            state.update({"readout.start": self._start, "readout.r0": self._r0,
                          "readout.refined": torch.tensor(self.refined),
                          "readout.evaluations": torch.tensor(self.evaluations),
                          "readout.subdivided": torch.tensor(self.subdivided)})
        if self._m_full is not None and self._m_sites is not None:
            state["m.full"] = self._m_full
            for s, m in zip(self.sites, self._m_sites):
                state[f"m.{s.layer}:{s.pos}:direct"], state[f"m.{s.layer}:{s.pos}:pre_cached"] = m[0], m[1]
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step = int(state["step"])
        self._m_sites = self._m_full = None
        self._start, self._r0 = state.get("readout.start"), state.get("readout.r0")
        if self._r0 is None and "readout.floor" in state:  # a resume point written before the cap: floor · |R_0|
            self._r0 = state["readout.floor"] / self.exact_readout.floor
        self.refined, self.evaluations, self.subdivided = (int(state.get(f"readout.{k}", 0))
                                                           for k in ("refined", "evaluations", "subdivided"))
        if "m.full" in state:
            m_full, m_sites = self.moments(state["m.full"])
            m_full.copy_(state["m.full"])
            for s, m in zip(self.sites, m_sites):
                for j, comp in enumerate(("direct", "pre_cached")):
                    key = f"m.{s.layer}:{s.pos}:{comp}"
                    if key in state:
                        m[j].copy_(state[key])

    # ---- one step ----
    def final_projections(self, tokens: torch.Tensor) -> torch.Tensor:
        """⟨w, r*⟩ of every probe on ``tokens`` [batch, pos]: [batch, n_probes], r* from θ*'s ordinary forward, in
        float64 (float32 on MPS) so that ⟨w, r⟩ − ⟨w, r*⟩ keeps the accuracy of (r − r*)·w."""
        n_pos = max(s.pos for s in self.sites) + 1
        with torch.no_grad():
            frozen = self.final(tokens[:, :n_pos], return_resid=True, myopic="none")[1]
        dtype = _projection_dtype(tokens.device)
        return torch.stack([frozen[p.site.layer][:, p.site.pos].to(dtype) @ p.w.to(frozen[0].device, dtype)
                            for p in self.probes], 1)

    def use_dataset(self, tokens: torch.Tensor, chunk: int = 256) -> None:
        """Register the fixed dataset a replay draws its batches from (tokens [n_examples, pos]): θ* is fixed, so
        ``track(..., example_ids=...)`` then computes each example's ⟨w, r*⟩ once, for a whole chunk of ``chunk``
        consecutive examples at a time (always the same chunks, so a resumed replay gets the same bits), instead of
        one θ* forward per step. Memory: n_examples × n_probes numbers (not × parameters)."""
        self._dataset, self._chunk = tokens, chunk
        self._proj = tokens.new_zeros((len(tokens), len(self.probes)), dtype=_projection_dtype(tokens.device))
        self._proj_done = torch.zeros(-(-len(tokens) // chunk), dtype=torch.bool)

    def use_readout(self, tokens: torch.Tensor, types: dict[str, torch.Tensor] | None = None,
                    levels: Sequence[int] = (2, 4, 8), rtol: float = 1e-3, floor: float = 1e-6,
                    pieces: Sequence[int] = (2, 4, 8, 16), cap: float = 1e-3) -> None:
        """Read R and R_c on the fixed readout set ``tokens`` [N, pos] (N ≥ 2; ``types``: their type labels)
        instead of each step's batch, and integrate each step exactly (the exact account, docs/balance.md).

        A step's change of R_H, R_H(θ_t) − R_H(θ_t − Δ) with Δ the real step as subtracted, is measured by plain
        forwards (the end is the next step's start: one forward per step); each component's share is the path
        integral ∫₀¹ ∇R_H(θ_t − sΔ)·Δ_c ds by the ``levels[0]``-point Gauss–Legendre rule, and the components add up
        to the full. Its ``residual`` (full − change) is recorded; a step whose residual exceeds
        min(``rtol`` · |change|, ``cap`` · R_H(θ_0)) + ``floor`` · R_H(θ_0) for some risk is re-integrated with the
        next level's points, and after the last level with the composite rules: the step split into ``pieces[0]``,
        ``pieces[1]``, … equal parts (up to the last), the last level's points on each, while each split after the
        first at least halves the worst risk's excess over its tolerance (:meth:`Readout.settles`). A step that
        settles earlier is integrated exactly as without them. ``attribute`` (alone or over a run axis) takes the
        same rule through each run's account (``ntpflow.engine.replay_account``, which also keeps the influence
        matrices); this reading stays for a loop of one's own and as the tests' independent path."""
        if len(tokens) < 2:
            raise ValueError("the readout set needs at least 2 sequences (R_c is a variance)")
        n_pos = max(s.pos for s in self.sites) + 1
        if any(k < 2 for k in pieces) or list(pieces) != sorted(set(pieces)):
            raise ValueError(f"pieces must be increasing counts ≥ 2, not {tuple(pieces)}")
        self.readout = Readout(tokens[:, :n_pos], self.final_projections(tokens), types, tuple(levels), rtol, floor,
                               tuple(pieces), cap)
        self._start = self._r0 = None
        self.refined = self.evaluations = self.subdivided = 0

    def _cached_projections(self, example_ids: torch.Tensor) -> torch.Tensor:
        """⟨w, r*⟩ [batch, n_probes] of the dataset's examples ``example_ids`` [batch], chunks filled on demand."""
        assert self._dataset is not None  # use_dataset() first
        for c in torch.unique(example_ids.cpu() // self._chunk).tolist():
            if not self._proj_done[c]:
                rows = slice(c * self._chunk, (c + 1) * self._chunk)
                self._proj[rows] = self.final_projections(self._dataset[rows])
                self._proj_done[c] = True
        return self._proj[example_ids.to(self._proj.device)]

    def risk_coefficients(self, resid: list[torch.Tensor], final_proj: torch.Tensor,
                          feature_types: dict[str, torch.Tensor] | None, w: torch.Tensor | None = None):
        """For every probe, type subset and mismatch: (probe, type, mismatch, R, a [batch]) with ``a[:, None] * w``
        the cotangent of R at the site: a = 2e/n, e = d (paper) or d − d̄ (centred) on the subset's rows, 0 elsewhere.
        The centred a is the exact gradient of R_c, since Σ_b (d_b − d̄) = 0. R is a 0-dim tensor (no host sync per
        risk; ``track`` reads every value back at once).

        resid: list of [batch, pos, d_model] for θ; final_proj: ⟨w, r*⟩ [batch, n_probes] (``final_projections``);
        feature_types: {probe name: int [batch, pos]}; w: the probes' directions [n_probes, d_model] (default: the
        probes' own). d = ⟨w, r⟩ − ⟨w, r*⟩ in final_proj's dtype. The type subsets of every probe (the types
        present in its column, ascending) come from one host sync for all probes.
        """
        typed = [] if feature_types is None else [(j, feature_types[p.name][:, p.site.pos])
                                                  for j, p in enumerate(self.probes) if p.name in feature_types]
        present: dict[int, list[int]] = {}
        if typed:  # one unique over (probe, type) pairs: one host sync per step, not one per probe
            pairs = torch.cat([torch.stack([torch.full_like(ft, j), ft], 1) for j, ft in typed])
            for j, t in torch.unique(pairs, dim=0).tolist():
                present.setdefault(j, []).append(t)
        cols = dict(typed)
        out = []
        for j, p in enumerate(self.probes):
            w_j = p.w if w is None else w[j]
            diff = resid[p.site.layer][:, p.site.pos].to(final_proj) @ w_j.to(final_proj) - final_proj[:, j]
            subsets = [(-1, None)] + [(t, cols[j] == t) for t in present.get(j, [])]
            for t, rows in subsets:
                if rows is None:  # the whole batch
                    n = len(diff)
                    d, dc = diff, diff - diff.sum() / n
                else:
                    n = rows.sum()
                    d = torch.where(rows, diff, 0.0)
                    dc = torch.where(rows, diff - d.sum() / n, 0.0)
                for mismatch, e in zip(MISMATCHES, (d, dc)):
                    out.append((p, t, mismatch, e.pow(2).sum() / n, (2 * e / n).to(resid[0].dtype)))
        return out

    def track(self, model: GPT, opt: torch.optim.Optimizer, tokens: Tokens, loss_mask: Mask | None = None,
              feature_types: dict[str, Labels] | None = None, example_ids: Rows | None = None) -> list[dict]:
        """Influence rows for this step (see class docstring). ``feature_types`` maps a probe name to int
        [batch, pos] type labels (e.g. Othello square types); probes without an entry get whole-batch risks.
        ``example_ids`` [batch]: the batch's rows in the dataset given to ``use_dataset`` (θ* projections cached).

        How (docs/engine.md): one ordinary backward and one cached ordinary forward (``Primals``) serve everything;
        the tensor work is :meth:`influences`, the rows come from one host sync of its values.
        """
        kind, group = _check_optimizer(opt)
        params = list(model.parameters())
        passes = SitePasses(model, tokens, self.sites, loss_mask)  # backward, own cotangents, cached forward
        self._last_grads = (model, passes.param_grads)
        adam: AdamStep | MomentumStep | None = None  # the optimizer's own moment-based split; None for plain SGD
        if kind == "adam":
            m_full, m_sites = self.moments(passes.full)
            adam = AdamStep(*adam_second_moment(opt, params), group["betas"], group["eps"], m_full, m_sites)
        elif kind == "momentum":
            adam = MomentumStep(group["momentum"], *self.moments(passes.full))
        if self.readout is not None:
            return self._exact_step(model, passes, group["lr"], adam)
        final_proj = (self.final_projections(tokens) if example_ids is None or self._dataset is None
                      else self._cached_projections(example_ids))
        midpoint = ((lambda step: self._midpoint_primals(model, step, passes.primals.tokens)) if self.midpoint
                    else None)
        values, layout = self.influences(passes, final_proj, self.directions, feature_types, group["lr"], adam,
                                         midpoint)
        rows = self.rows(values.tolist(), layout, group["lr"])  # one device sync
        self.step += 1
        return rows

    def influences(self, passes: SitePasses, final_proj: torch.Tensor, w: torch.Tensor,
                   feature_types: dict[str, torch.Tensor] | None, lr: float, adam: "AdamStep | MomentumStep | None",
                   midpoint=None) -> tuple[torch.Tensor, tuple]:
        """The tensor work of one tracked step: (values [n_values] float64, their layout for :meth:`rows`).

        passes: the batch's ``SitePasses``; final_proj: ⟨w, r*⟩ [batch, n_probes]; w: the probes' directions
        [n_probes, d_model]; adam: this step's Adam quantities, whose first moments are updated in place (None for
        SGD); midpoint: ``step [n_params] -> Primals`` at θ − step/2, or None to read ∇R at θ. Free of host syncs
        and of optimizer lookups without ``feature_types``, so it runs under ``torch.func.vmap`` over a run axis
        (``ntpflow.engine.run_axis``) with every tensor argument batched.

        A risk's influence along an update δ is ``∇θR · δ = Σ_b a_b ⟨w, (J δ)_b⟩`` with J = ∂r^k_i/∂θ in the
        ordinary graph: forward-mode tangents along the full gradient and the full Adam step once for every site
        (``all_tangents``), along each site's direct and pre-cached updates (``site_tangents``, prefix ≤ i only; the
        parts from ``SitePasses.run_many``, the hand-written reverse mode). Both run per bucket of sites of one layer
        (``buckets``). Shared parts follow as full − direct − pre. No per-risk gradient vector is formed.
        """
        risks = self.risk_coefficients(passes.primals.resid, final_proj, feature_types, w)
        shared_dirs, scale, sgd = self._shared_directions(passes.full, lr, adam)
        if midpoint is not None:  # ∇R read at θ_t − Δ/2: its own forward, risk coefficients and tangents
            primals = midpoint(shared_dirs[-1] if adam is not None else lr * passes.full)
            node = (None, primals, self.risk_coefficients(primals.resid, final_proj, feature_types, w))
        else:
            node = (None, passes.primals, risks)  # the ordinary forward over positions < n_pos, also when myopic
        pending = self._integrate(passes, [node], w, shared_dirs, scale, sgd, adam, update=True)
        return self._values(risks, pending, sgd, adam, passes.full)

    def _shared_directions(self, g_full: torch.Tensor, lr: float, adam: "AdamStep | MomentumStep | None", update: bool = True):
        """The directions every site shares, [m0, n_params]: the full gradient (SGD rows) and the real Adam step
        (updating the full first moment in place unless ``update`` is False: a step integrated again reads the
        moment as updated), with Adam's per-parameter scale [n_params] (None for SGD) and whether SGD rows are
        computed. The last direction is the step actually taken (for SGD, divided by lr)."""
        sgd = adam is None or self.sgd_rows
        shared_dirs, scale = [g_full] if sgd else [], None
        if adam is not None:
            scale = adam.scale(lr, g_full)
            if update:
                adam.advance(adam.m_full, g_full)
            shared_dirs.append(scale * adam.m_full)  # the real step
        return torch.stack(shared_dirs), scale, sgd

    def _values(self, risks: list, pending: list, sgd: bool, adam: "AdamStep | MomentumStep | None", like: torch.Tensor):
        """(values [n_values] float64, layout) of a step's risks and its sites' influences (see ``influences``)."""
        values = torch.cat([torch.stack([r[3].to(torch.float64) for r in risks])]
                           + [v.flatten().to(torch.float64) for *_, v in pending]) if risks else like.new_zeros(0)
        sites = [([r[:3] for r in mine], with_pre, v.shape[1]) for mine, with_pre, v in pending]
        layout = ([r[:3] for r in risks], sites, sgd, _own(adam))  # (probe, type, mismatch) of each value
        return values, layout

    def _integrate(self, passes: SitePasses, nodes: list, w: torch.Tensor, shared_dirs: torch.Tensor, scale,
                   sgd: bool, adam: "AdamStep | MomentumStep | None", update: bool, mats: dict | None = None) -> list:
        """Per site: (its risks, with_pre, Σ_j ω_j ∇R(θ_j)·δ [risks, m]) over the directions δ of every component.

        nodes: [(weight ω_j or None for 1, Primals at θ_j, risk_coefficients there)], each point's forward (on the
        same tokens for every node); shared_dirs [m0, n_params] and scale from ``_shared_directions``; ``update``:
        advance the sites' Adam first moments (once per step; a re-integration of the same step reads them);
        ``mats``: a dict that ``_matrix_terms`` fills with each site's matrix accumulators (the account's), or None.
        """
        primals, n_pos = nodes[0][1], max(s.pos for s in self.sites) + 1
        tokens, n_layers = primals.tokens, max(s.layer for s in self.sites)
        # the shared directions once for all sites (full blocks over n_pos positions), unless the sites' own prefixes
        # are less work (e.g. a single site): then they ride along in each site's tangents
        once = sum(s.layer * (s.pos + 1) for s in self.sites) > n_layers * n_pos
        tau_shared = [all_tangents(pr, n_layers, n_pos, shared_dirs) if once else None  # [m0, batch, n_pos, d]
                      for _, pr, _ in nodes]
        by_site = [self._risks_by_site(coef, w, tokens.device) for *_, coef in nodes]
        pending = []  # per site: (its risks, with_pre, influences [risks, directions])
        for bucket in self.buckets(len(tokens), tokens.device):  # sites of one layer together; bounds memory
            sites = self.sites[bucket]
            k, n = sites[0].layer, len(sites)
            pos = torch.tensor([s.pos for s in sites])  # on the CPU (indices, no device sync)
            parts = passes.run_many(sites)  # [n, 2, n_params]: direct, pre-cached
            with_pre = passes.has_pre_cached(sites[0])
            n_own = 2 if with_pre else 1  # pre-cached parts (and their moments) are exactly 0 when structurally absent
            m_dirs = n_own * (sgd + (adam is not None)) + (0 if once else len(shared_dirs))
            dirs = parts.new_empty((n, m_dirs, parts.shape[-1]))  # the directions, written in place (no cat)
            at = 0
            if sgd:
                dirs[:, :n_own] = parts[:, :n_own]
                at = n_own
            if adam is not None:
                moments = adam.m_sites[bucket, :n_own]  # a view [n, n_own, n_params]
                if update:
                    adam.advance(moments, parts[:, :n_own])
                dirs[:, at:at + n_own] = scale * moments
                at += n_own
            if not once:
                dirs[:, at:] = shared_dirs
            acc: dict[Site, torch.Tensor] = {}
            for (weight, pr, _), node_sites, node_shared in zip(nodes, by_site, tau_shared):
                tau = site_tangents(pr, k, pos.repeat_interleave(m_dirs), dirs.flatten(0, 1))
                tau = tau.view(n, m_dirs, *tau.shape[1:])  # [n, m, batch, d]
                if node_shared is not None:  # the shared directions' tangents, computed once for all sites
                    tau = torch.cat([tau, node_shared[k][:, :, pos.to(tau.device)].movedim(2, 0)], 1)
                for site, tau_site in zip(sites, tau):
                    if mats is not None:
                        self._matrix_terms(mats, site, pr.resid[k][:, site.pos], tau_site, weight, with_pre, sgd,
                                           adam is not None)
                    if site not in node_sites:
                        continue
                    mine, w_site, sel = node_sites[site]
                    proj = tau_site @ w_site.to(tau_site)  # [m, batch, probes]: ⟨w, Jδ⟩
                    coef = torch.stack([a for *_, a in mine], 1)  # [batch, risks]
                    v = (proj.index_select(2, sel) * coef).sum(1).T  # [risks, m]: ∇R·δ
                    v = v if weight is None else weight * v
                    acc[site] = v if site not in acc else acc[site] + v
            pending += [(by_site[0][site][0], with_pre, acc[site]) for site in sites if site in acc]
        return pending

    def _matrix_terms(self, mats: dict, site: Site, resid: torch.Tensor, tau: torch.Tensor, weight, with_pre: bool,
                      sgd: bool, adam: bool) -> None:
        """Add one quadrature point's share of the matrix accumulators to ``mats[site]`` (``_integrate``'s ``mats``):
        the exact account's (``ntpflow.engine.exact``); the tracker keeps none."""
        raise NotImplementedError("the tracker keeps no matrix accumulators (ntpflow.engine.exact.ExactAccount does)")

    def _exact_step(self, model: GPT, passes: SitePasses, lr: float, adam: "AdamStep | MomentumStep | None") -> list[dict]:
        """This step's rows in readout mode (``use_readout``): the risks R_H(θ_t), each component's path integral,
        and per risk the exact change (``change``, optimizer none) and the rule's ``residual`` (full − change).
        The tensor work is :meth:`exact_integral`; this adds the host's part: the refinement and the rows."""
        ro, w = self.exact_readout, self.directions
        if self._start is None:  # θ_0: its plain forward (later starts are the previous step's end)
            primals = Primals(model, ro.tokens, self.top_layer)
            self._start = self._readout_risks(primals, ro.final_proj, ro.types, w)[1]
            self._r0 = self._start.abs()
        previous = math.inf
        for level, (n, pieces) in enumerate(ro.rules):
            scratch = itertools.count()  # scratch weights: the end, then n per piece (a piece's are done before the next)
            points = lambda step, s: Primals(self._point(model, step, s, next(scratch) % (n + 1)),  # noqa: E731
                                             ro.tokens, self.top_layer)
            values, end, full, layout = self.exact_integral(passes, lr, adam, points, n, ro.final_proj, w, ro.types,
                                                            update=level == 0, pieces=pieces)
            assert self._start is not None and self._r0 is not None
            excess = float(ro.excess(self._start - end, full, self._r0).max())  # one host sync
            if ro.settles(level, excess, previous):
                break
            previous = excess
        return self.exact_rows(values, end, full, layout, lr, level)

    def exact_integral(self, passes: SitePasses, lr: float, adam: "AdamStep | MomentumStep | None", points, n: int,
                       final_proj: torch.Tensor, w: torch.Tensor, types: dict[str, torch.Tensor] | None,
                       update: bool, pieces: int = 1):
        """The tensor work of one step of the exact account with the ``n``-point Gauss–Legendre rule on each of
        ``pieces`` equal parts of the step (one: the plain rule; pieces are integrated one after another, so memory
        is that of one n-point rule): (the
        components' integrals [n_values] float64, R_H at the step's end [n_risks] float64, the full integral along
        the real step [n_risks] float64, the layout for :meth:`exact_rows`).

        points(step, s): the readout set's ``Primals`` at θ − s·step (``step`` flat [n_params], as subtracted), each
        call on its own weights; final_proj: θ*'s projections on the readout set [N, n_probes]; w [n_probes,
        d_model]; ``update``: advance the first moments (the first rule of a step; a refinement reads them). Free of
        host syncs without ``types``."""
        shared_dirs, scale, sgd = self._shared_directions(passes.full, lr, adam, update)
        step = shared_dirs[-1] if adam is not None else lr * passes.full  # the real step, as subtracted
        risks, end = self._readout_risks(points(step, 1.0), final_proj, types, w)
        rule = composite_gauss_legendre(n, pieces)
        pending: list | None = None
        for j in range(pieces):
            nodes = []
            for s, weight in rule[j * n:(j + 1) * n]:
                pr = points(step, s)
                nodes.append((weight, pr, self.risk_coefficients(pr.resid, final_proj, types, w)))
            part = self._integrate(passes, nodes, w, shared_dirs, scale, sgd, adam, update and j == 0)
            pending = part if pending is None else [(*a[:2], a[2] + b[2]) for a, b in zip(pending, part)]
        assert pending is not None  # pieces ≥ 1
        index = {(id(p), t, m): j for j, (p, t, m, *_) in enumerate(risks)}
        order = [index[(id(r[0]), r[1], r[2])] for mine, *_ in pending for r in mine]
        along = torch.cat([v[:, -1] for *_, v in pending]).to(end) * (1.0 if adam is not None else lr)
        full = along[torch.as_tensor(order, device=along.device).argsort()]  # risk order (each risk once)
        values = torch.cat([v.flatten().to(torch.float64) for *_, v in pending])
        sites = [([r[:3] for r in mine], with_pre, v.shape[1]) for mine, with_pre, v in pending]
        return values, end, full, ([r[:3] for r in risks], sites, sgd, _own(adam))

    def exact_rows(self, values: torch.Tensor, end: torch.Tensor, full: torch.Tensor, layout: tuple, lr: float,
                   level: int) -> list[dict]:
        """The rows of a step integrated by :meth:`exact_integral` (risk rows at the step's start, the components,
        ``change`` and ``residual``), from one host sync; the end becomes the next step's start."""
        assert self._start is not None
        change = self._start - end
        host = torch.cat([self._start, values.to(self._start), change, full - change]).tolist()
        n_risks = len(layout[0])
        rows = self.rows(host[:len(host) - 2 * n_risks], layout, lr)
        kind = layout[3] or "sgd"
        for (p, t, m), c, r in zip(layout[0], host[-2 * n_risks:-n_risks], host[-n_risks:]):
            rows += [self._row(p, t, m, "change", "none", c), self._row(p, t, m, "residual", kind, r)]
        rules = self.exact_readout.rules
        self.evaluations += sum(n * k for n, k in rules[:level + 1])
        self.refined += level > 0
        self.subdivided += rules[level][1] > 1
        self._start = end
        self.step += 1
        return rows

    def _readout_risks(self, primals: Primals, final_proj: torch.Tensor, types, w: torch.Tensor
                       ) -> tuple[list, torch.Tensor]:
        """The risks on the readout set at ``primals``' weights: their layout (``risk_coefficients``) and R_H
        [n_risks] float64."""
        risks = self.risk_coefficients(primals.resid, final_proj, types, w)
        return risks, torch.stack([r[3].to(torch.float64) for r in risks])

    def _point(self, model: GPT, step: torch.Tensor, s: float, j: int) -> GPT:
        """Scratch weights number ``j`` set to θ − s·step (``step`` flat [n_params], the update as subtracted)."""
        while len(self._points) <= j:
            self._points.append(copy.deepcopy(model))
        with torch.no_grad():
            for m, p, d in zip(self._points[j].parameters(), model.parameters(),
                               step.split([p.numel() for p in model.parameters()])):
                torch.sub(p, d.view_as(p), alpha=s, out=m)
        return self._points[j]

    def rows(self, values: list[float], layout: tuple, lr: float) -> list[dict]:
        """This step's rows from :meth:`influences`' values (as Python floats) and layout."""
        risks, pending, sgd, adam = layout
        rows = [self._row(p, t, m, "risk", "none", v) for (p, t, m), v in zip(risks, values)]
        start = len(risks)
        for mine, with_pre, n_dirs in pending:
            for j, (p, t, m) in enumerate(mine):
                at = start + j * n_dirs
                rows += self._influence_rows(p, t, m, values[at:at + n_dirs], with_pre, sgd, adam, lr)
            start += len(mine) * n_dirs
        return rows

    def _midpoint_primals(self, model: GPT, step: torch.Tensor, tokens: torch.Tensor) -> Primals:
        """The cached ordinary forward at θ − step/2 (``step`` flat [n_params], the update as subtracted)."""
        if self._middle is None:
            self._middle = copy.deepcopy(model)
        with torch.no_grad():
            for m, p, s in zip(self._middle.parameters(), model.parameters(),
                               step.split([p.numel() for p in model.parameters()])):
                torch.sub(p, s.view_as(p), alpha=0.5, out=m)
        return Primals(self._middle, tokens, self.top_layer)

    def _risks_by_site(self, risks: list, w: torch.Tensor, device: torch.device) -> dict:
        """{site: (its risks, its probes' directions [d_model, probes], column of each risk's probe [risks])}: the
        columns of every site from one host-to-device copy (none per site); w: [n_probes, d_model]."""
        groups: dict[Site, list] = {}
        for r in risks:
            groups.setdefault(r[0].site, []).append(r)
        index = {id(p): j for j, p in enumerate(self.probes)}
        out, cols = {}, []
        for site, mine in groups.items():
            probes = list(dict.fromkeys(r[0] for r in mine))
            col = {id(p): j for j, p in enumerate(probes)}
            cols.append([col[id(r[0])] for r in mine])
            out[site] = (mine, w[[index[id(p)] for p in probes]].T)
        if not cols:
            return {}
        flat = torch.tensor([c for cs in cols for c in cs], dtype=torch.long).to(device).split([len(c) for c in cols])
        return {site: (*out[site], sel) for site, sel in zip(out, flat)}

    def optimizer_step(self, model: GPT, opt: torch.optim.Optimizer) -> None:
        """The training step of the batch just tracked, on the gradient of ``track``'s own ordinary backward instead
        of a second forward and backward. That backward runs the same ops as ``training.train_step`` (the model's
        forward in its own regime, ``lm_loss``, one backward), so the parameters come out bit for bit as there
        (tests compare them; a replay checks its final weights). Leaves ``.grad`` set, as train_step does."""
        if self._last_grads is None or self._last_grads[0] is not model:
            raise RuntimeError("optimizer_step follows a track() of the same model and batch")
        grads, self._last_grads = self._last_grads[1], None
        opt.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()

    def _influence_rows(self, p, t, m, v, with_pre, sgd, adam, lr) -> list[dict]:
        """Rows from ∇R·δ for the site's directions [(g_dir, g_pre)?, (Δ_dir, Δ_pre)?, (g_full)?, (Δ_full)?]."""
        n_own = 2 if with_pre else 1
        n_shared = sgd + bool(adam)
        own, shared = v[:len(v) - n_shared], v[len(v) - n_shared:]
        rows = []
        for name, on in (("sgd", sgd), (adam, bool(adam))):
            if not on:
                continue
            scale = lr if name == "sgd" else 1.0
            dv, pv = own[0], own[1] if with_pre else 0.0
            own, full = own[n_own:], shared.pop(0)
            dv, pv, fv = scale * dv, scale * pv, scale * full
            rows += [self._row(p, t, m, c, name, x) for c, x in zip(COMPONENTS, (dv, pv, fv - dv - pv, fv))]
        return rows

    def _ensure_moments(self, g_full: torch.Tensor) -> None:
        """Allocate the stacked first moments on the first step: per-site [n_sites, 2, n_params] (direct,
        pre-cached) and the full one [n_params], zero (so the first update gives (1−β1)·g exactly)."""
        if self._m_sites is None or self._m_sites.shape[-1] != g_full.numel():
            self._m_sites = g_full.new_zeros((len(self.sites), 2, g_full.numel()))
            self._m_full = g_full.new_zeros(g_full.numel())

    def _row(self, p: Probe, t: int, mismatch: str, component: str, optimizer: str, value: float) -> dict:
        return {"step": self.step, "layer": p.site.layer, "pos": p.site.pos, "feature": p.name,
                "feature_type": t, "mismatch": mismatch, "component": component, "optimizer": optimizer,
                "value": value}


def _own(step: "AdamStep | MomentumStep | None") -> str:
    """The optimizer column of the rows of the optimizer's own split ("adam", "momentum"); "" without one."""
    return "" if step is None else step.name
