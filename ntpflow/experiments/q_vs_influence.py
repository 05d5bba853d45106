"""Beyond the paper: does Q(w) by ablation track the true ratio of pre-caching to direct influence?

The paper's reviewers asked whether Q(w) (docs/paper.md#q), a first-order proxy, tracks ``I_pre-cached / I_direct``.
On ntpflow's own small models both are computable:

* Q by ablation for a probe direction ``w`` at site (layer, pos) of the **final** model: project the component along
  ``w`` out of ``resid[layer][:, pos]`` (``x <- x - (x . w_hat) w_hat``; nothing else changes, the analogue of the
  error-preserving mode), ``d_m = KL(clean || ablated)`` of the predictions at ``pos + m - 1``, ``m = 1 .. H`` with
  ``H = min(horizon, T - 1 - pos)`` (every prediction of a token inside the sequence; the toy tasks' loss mask covers
  all of them), ``Q = mean over sequences of sum_{m >= 2} d_m / (d_1 + 1e-8)`` - the reference's estimator;
* ``I_pre-cached`` and ``I_direct`` from the replay's ``attribution/influence.parquet``: Adam, ``feature_type == -1``,
  the ``cumulative`` value at the last step, per (layer, pos, feature).

``resid[layer]`` is the input of block ``layer`` (``blocks.{layer}.hook_resid_pre``) for ``layer < n_layer`` and the
output of the last block (``blocks.{n_layer-1}.hook_resid_post``) for ``layer == n_layer``, as
``GPT.forward(return_resid=True)`` numbers them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from ntpflow.llm.qscan import q_from_kl
from ntpflow.model.hooks import hooks
from ntpflow.model.sites import Site, resid_hook_name
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run
from ntpflow.stats import spearman


@torch.no_grad()
def probe_ablation_kl(model: Any, tokens: torch.Tensor, layer: int, pos: int, w: torch.Tensor, horizon: int = 10,
                      batch_size: int = 512) -> torch.Tensor:
    """``d`` ``[N, H]``: ``KL(clean || ablated)`` of the predictions at ``pos .. pos+H-1`` after projecting ``w``
    ``[d_model]`` out of ``resid[layer][:, pos]``, for ``tokens`` ``[N, T]``; ``H = min(horizon, T - 1 - pos)``.
    A zero ``w`` ablates nothing (``d == 0``)."""
    n_layer = model.cfg.n_layer
    T = tokens.shape[1]
    if not 0 <= pos < T - 1:
        raise ValueError(f"position {pos} has no later prediction in sequences of length {T}")
    H = min(horizon, T - 1 - pos)
    name = resid_hook_name(layer, n_layer)
    dev = next(model.parameters()).device
    w = torch.as_tensor(w, dtype=torch.float32, device=dev).reshape(-1)
    nrm = float(w.norm())
    u = w / nrm if nrm > 0 else torch.zeros_like(w)

    def ablate(act: torch.Tensor, hook: Any) -> torch.Tensor:
        act = act.clone()
        x = act[:, pos]
        act[:, pos] = x - (x @ u.to(x.dtype))[:, None] * u.to(x.dtype)
        return act

    was = model.training
    model.eval()
    out = []
    try:
        for i in range(0, tokens.shape[0], batch_size):
            t = tokens[i:i + batch_size].to(dev)
            clean = model(t, myopic="none")[:, pos:pos + H].double()
            with hooks(model, [(name, ablate)]):
                abl = model(t, myopic="none")[:, pos:pos + H].double()
            lc, la = torch.log_softmax(clean, -1), torch.log_softmax(abl, -1)
            out.append((lc.exp() * (lc - la)).sum(-1).clamp(min=0).cpu())
    finally:
        model.train(was)
    return torch.cat(out)


def influence_ratios(parquet: str | Path, optimizer: str = "adam", mismatch: str = "paper"
                     ) -> dict[tuple[int, int, str], dict]:
    """``{(layer, pos, feature): {"pre_cached", "direct", "shared", "full"}}``: cumulative integrated influence at
    the last step, ``feature_type == -1``, for ``optimizer`` and ``mismatch`` ("paper" R or "centred" R_c)."""
    t = pq.read_table(parquet)
    # pyarrow.compute functions are generated at import; not in the stubs
    keep = pc.and_(  # pyright: ignore[reportAttributeAccessIssue]
        pc.and_(pc.equal(t["optimizer"], optimizer),  # pyright: ignore[reportAttributeAccessIssue]
                pc.equal(t["feature_type"], -1)),  # pyright: ignore[reportAttributeAccessIssue]
        pc.equal(t["mismatch"], mismatch))  # pyright: ignore[reportAttributeAccessIssue]
    t = t.filter(keep)
    rows = t.select(["step", "layer", "pos", "feature", "component", "cumulative"]).to_pylist()
    if not rows:
        raise ValueError(f"{parquet} has no {optimizer} rows with feature_type -1")
    last = max(r["step"] for r in rows)
    out: dict[tuple[int, int, str], dict] = {}
    for r in rows:
        if r["step"] == last:
            out.setdefault((r["layer"], r["pos"], r["feature"]), {})[r["component"]] = float(r["cumulative"])
    return out


def q_vs_influence(run_dir: str | Path, horizon: int = 10, n_sequences: int = 1024, device: str = "cpu") -> dict:
    """Q by ablation for every attributed probe of a finished, attributed toy run and its influence ratio.

    Args:
        run_dir: a run with ``probes/`` and ``attribution/influence.parquet`` (``ntpflow.replay.attribution.attribute``).
        horizon: the Q horizon (clipped per site to the sequence).
        n_sequences: eval sequences used (the first ones of the run's eval set).
        device: torch device.

    Returns:
        ``{"rows": [{layer, pos, feature, q, total_kl, H, pre_cached, direct, shared, ratio, share, and the same five
        with suffix _centred}], "spearman": {...} (Q vs pre_cached/direct), "spearman_share": {...} (Q vs
        pre_cached/(|pre_cached|+|direct|)), "spearman_centred", "spearman_share_centred": the same for the influence
        on the centred mismatch R_c (ntpflow.engine.influence),
        "spearman_full_horizon": {...} (only sites with the full horizon H), "final_layer": {...},
        "n_sequences", "horizon", "n_layer"}``. The correlations use the sites with ``layer < n_layer`` only: at
        the last residual (after the last block) nothing later reads the position, so Q and I_pre-cached are both 0
        by construction (``final_layer`` records their largest absolute values as a check).
    """
    run = Run.open(run_dir)
    probes = load_or_probe(run, "final", device)
    parquet = run.attribution().influence
    infl, centred = influence_ratios(parquet), influence_ratios(parquet, mismatch="centred")
    model = run.load_model("final", device)
    _, eval_set = run.datasets()
    tokens = torch.as_tensor(eval_set.tokens[:n_sequences]).long()
    rows = []
    for (layer, pos, feat), comp in sorted(infl.items()):
        w = probes.direction(layer, pos, feat)
        if pos > tokens.shape[1] - 3:  # fewer than 2 predictions after pos
            continue
        d = probe_ablation_kl(model, tokens, layer, pos, w, horizon)
        q, tot = q_from_kl(d)
        row = {"layer": layer, "pos": pos, "feature": feat, "q": q, "total_kl": tot, "H": int(d.shape[1])}
        for suffix, c in (("", comp), ("_centred", centred.get((layer, pos, feat), {}))):
            pre, direct = c.get("pre_cached", math.nan), c.get("direct", math.nan)
            row |= {f"pre_cached{suffix}": pre, f"direct{suffix}": direct, f"shared{suffix}": c.get("shared", math.nan),
                    f"ratio{suffix}": pre / direct if direct != 0 else math.nan,
                    f"share{suffix}": pre / (abs(pre) + abs(direct)) if abs(pre) + abs(direct) > 0 else math.nan}
        rows.append(row)
    n_layer = run.model_config().n_layer
    inner = [r for r in rows if r["layer"] < n_layer]
    full = [r for r in inner if r["H"] == horizon]
    last = [r for r in rows if r["layer"] == n_layer]
    return {"rows": rows, "n_layer": n_layer,
            "spearman": spearman([r["q"] for r in inner], [r["ratio"] for r in inner]),
            "spearman_share": spearman([r["q"] for r in inner], [r["share"] for r in inner]),
            "spearman_centred": spearman([r["q"] for r in inner], [r["ratio_centred"] for r in inner]),
            "spearman_share_centred": spearman([r["q"] for r in inner], [r["share_centred"] for r in inner]),
            "spearman_full_horizon": spearman([r["q"] for r in full], [r["ratio"] for r in full]),
            "final_layer": {"n": len(last), "max_abs_q": max((abs(r["q"]) for r in last), default=None),
                            "max_abs_pre_cached": max((abs(r["pre_cached"]) for r in last), default=None)},
            "n_sequences": int(tokens.shape[0]), "horizon": horizon}


def toy_sites(layers: Sequence[int], positions: Sequence[int]) -> list:
    """``[Site(layer, pos)]`` for every pair."""
    return [Site(k, p) for k in layers for p in positions]
