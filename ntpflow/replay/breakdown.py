"""Why a row cancels: one step's component influences split over the parameter tensors, with the optimizer's scale.

``breakdown(run_dir, steps, sites)`` replays a finished run (the run's own ``train_step``, bit for bit) up to the last
requested step, jumping to the newest checkpoint at or before ``warm`` steps ahead of each requested window. Within
``warm`` steps of a requested step it sums each site's component moments from the exact decomposition of every step's
gradient (``decompose``): Adam's first
moments m_c ← β1 m_c + (1 − β1) g_c, or the momentum buffers m_c ← μ m_c + g_c. Moments started at a checkpoint
instead of step 0 are short of their true value by a relative β1^warm at most (0.9^200 ≈ 7e-10, recorded as
``truncation``; exact when the replay starts at step 0). At each requested step t it reads, on the exact account's
readout set, the gradient of R_H along the real step (``points``-point Gauss–Legendre over θ_t − sΔ, by autograd)
and splits each component's path integral ∫∇R_H·Δ_c ds over the tensors, for the optimizer's reading (Δ_c = scale ⊙
m_c, the scale lr/(1 − β1^t)/(√v̂ + ε) of the full gradient; or lr · m_c) and the SGD direction (Δ_c = lr · g_c).
Beside each tensor's values: its step scale and √v̂ (medians, Adam), and the share of the tensor's |influence|
carried by parameters in Adam's ε regime (√v̂ < ε, where ε, not the gradient, sets the scale).

Output folder (default ``RUN_DIR/breakdown``): ``breakdown.parquet`` (one row per step × site × feature × mismatch
× reading × component × tensor, schema in docs/outputs.md) and ``summary.json`` (per step × site × feature ×
mismatch × reading: each component's total and its largest tensors, the exact change and the rule's residual).
"""

import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ntpflow.engine.decomposition import decompose, flat_grads
from ntpflow.engine.influence import (
    MISMATCHES,
    AdamStep,
    MomentumStep,
    adam_second_moment,
    gauss_legendre,
    mismatch_value,
)
from ntpflow.files import DirLock, ensure_writable_dir, resolve_device, stamp, write_json
from ntpflow.model.sites import Site
from ntpflow.replay.conditioning import PARTS
from ntpflow.replay.spec import AttributionSpec
from ntpflow.replay.tracked import make_probes, run_sites
from ntpflow.runs.data import DataOrder, to_torch
from ntpflow.runs.run import Run
from ntpflow.runs.training import make_optimizer, train_step

log = logging.getLogger(__name__)
TOP = 3  # tensors named per component in summary.json and the printed lines


def parse_steps(text: str, n_steps: int) -> list[int]:
    """``"2820-2822,1542"`` -> [1542, 2820, 2821, 2822]; ValueError (one line) outside 0..n_steps − 1."""
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise ValueError(f"--steps takes STEP or FIRST-LAST lists (e.g. 2820-2822,1542), got {text!r}") from None
        if not 0 <= lo <= hi < n_steps:
            raise ValueError(f"step range {part.strip()!r} is outside the run's steps 0..{n_steps - 1}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def breakdown(run_dir: str | Path, steps: Sequence[int], sites: Sequence[Site], features: Sequence[str] | None = None,
              *, readout: int | None = None, warm: int = 200, points: int = 8, out_dir: str | Path | None = None,
              device: str = "auto") -> Path:
    """Split ``steps``' component influences at ``sites`` × ``features`` over the parameter tensors (module
    docstring); returns the output folder. ``readout``: the exact account's readout set (default as ``attribute``)."""
    run = Run.open(run_dir)
    if not run.done:
        raise ValueError(f"{run_dir} has not finished training; a breakdown replays a finished run")
    cfg = run.cfg
    steps = sorted(set(steps))
    if not steps or steps[0] < 0 or steps[-1] >= cfg.steps:
        raise ValueError(f"steps must lie in 0..{cfg.steps - 1}")
    if warm < 0 or points < 1:
        raise ValueError("warm must be >= 0 and points >= 1")
    n_read = AttributionSpec(readout=readout).readout_size(cfg.n_eval, cfg.batch_size)
    assert n_read is not None  # the exact reading has a readout set (None is for the batch readings)
    dev = resolve_device(device if device != "auto" else cfg.device)
    sites = run_sites(run, sites)
    probes = make_probes(run, sites, features, device)
    out = ensure_writable_dir(Path(out_dir) if out_dir is not None else run.dir / "breakdown")
    with DirLock(out):
        rows, summary = _replay(run, steps, sites, probes, n_read, warm, points, dev)
        tmp = out / "breakdown.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        write_json(out / "summary.json", {"steps": steps, "readout": n_read, "points": points, "warm": warm,
                                          "optimizer": cfg.own_rows, "entries": summary, "stamp": stamp(),
                                          "sign": "positive = the component moved the feature toward its final "
                                                  "value"})
        tmp.replace(out / "breakdown.parquet")
    for line in breakdown_lines(summary):
        log.info(f"{run.name}: {line}")
    return out


def _replay(run: Run, steps: list[int], sites: list[Site], probes, n_read: int, warm: int, points: int, dev):
    cfg = run.cfg
    model = run.load_model("init", dev).train()
    opt = make_optimizer(model, cfg)
    train_set, eval_set = run.datasets()
    data = to_torch(train_set, dev)
    order = DataOrder(cfg.seed, cfg.n_train, cfg.batch_size)
    held = torch.as_tensor(eval_set.tokens[:n_read], device=dev)
    final = run.load_model("final", dev).eval()
    with torch.no_grad():
        r_star = final(held, return_resid=True, myopic="none")[1]
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    own = cfg.own_rows
    # {site: {component: [n_params]}} and "full"; None outside the warm window of a requested step
    moments: dict[Site | str, Any] | None = None
    rows, summary = [], []
    step, start = 0, 0  # the next step to take; the step the moments were started at
    while step <= steps[-1]:
        upcoming = next(s for s in steps if s >= step)
        if moments is None and upcoming - warm > step:  # jump to the newest checkpoint before the window, if any
            ckpt = max((c for c in run.checkpoints() if step < c <= upcoming - warm), default=None)
            if ckpt is not None:
                step = run.ckpts.load_latest(model, opt, dev, upto=ckpt)[0]
        i = order(step).to(dev)
        tokens, mask = data["tokens"][i], data["loss_mask"][i]
        if upcoming - step > warm:  # before the window: a plain step
            train_step(model, opt, tokens, mask)
            step, moments = step + 1, None
            continue
        if moments is None:
            start = step
            log.info(f"{run.name}: breakdown of step {upcoming}: moments summed from step {start}")
        parts = decompose(model, tokens, sites, mask)
        g_full = next(iter(parts.values())).full
        if moments is None:
            moments = {"full": torch.zeros_like(g_full)} | {s: {c: torch.zeros_like(g_full) for c in PARTS[:2]}
                                                            for s in sites}
        lr = opt.param_groups[0]["lr"]
        step_of = _step_rule(opt, model, moments)
        step_of.advance(moments["full"], g_full)
        for s in sites:
            for c in PARTS[:2]:
                step_of.advance(moments[s][c], getattr(parts[s], c))
        theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        scale = step_of.scale(lr, g_full)
        train_step(model, opt, tokens, mask)
        step += 1
        if step - 1 not in steps:
            continue
        step_taken = step - 1
        real = theta - torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # the step as subtracted
        grads, change = _path_gradients(model, theta, real, held, r_star, probes, points)
        sqrt_v = None if own != "adam" else _sqrt_vhat(opt, model)
        truncation = 0.0 if start == 0 else _decay(cfg) ** (step_taken - start + 1)
        for p in probes:
            for mismatch in MISMATCHES:
                gr = grads[p.name, p.site, mismatch]
                dirs = {"sgd": {c: lr * getattr(parts[p.site], c) for c in PARTS[:2]} | {"full": lr * g_full}}
                if own != "sgd":  # the optimizer's own split first (plain SGD's is the SGD direction itself)
                    dirs = {own: {c: scale * moments[p.site][c] for c in PARTS[:2]} | {"full": real}, **dirs}
                for reading, d in dirs.items():
                    per = {c: (gr * d[c]).split(sizes) for c in (*PARTS[:2], "full")}
                    eps_share = None if sqrt_v is None else (sqrt_v < opt.param_groups[0]["eps"])
                    entry = {"step": step_taken, "layer": p.site.layer, "pos": p.site.pos, "feature": p.name,
                             "mismatch": mismatch, "reading": reading, "change": change[p.name, p.site, mismatch],
                             "truncation": truncation, "components": {}}
                    for c in PARTS:
                        vals = ([a - b - e for a, b, e in zip(per["full"], per["direct"], per["pre_cached"])]
                                if c == "shared" else per[c])
                        tensor_rows = []
                        for j, (name, v) in enumerate(zip(names, vals)):
                            row = {"step": step_taken, "layer": p.site.layer, "pos": p.site.pos, "feature": p.name,
                                   "mismatch": mismatch, "reading": reading, "component": c, "tensor": name,
                                   "value": v.sum().item(), "abs": v.abs().sum().item(),
                                   "scale_median": None, "sqrt_vhat_median": None, "eps_share": None}
                            if reading != "sgd" and own == "adam":
                                assert isinstance(scale, torch.Tensor)  # Adam's: per parameter
                                assert sqrt_v is not None and eps_share is not None  # read for Adam above
                                sl = slice(sum(sizes[:j]), sum(sizes[:j + 1]))
                                row["scale_median"] = scale[sl].median().item()
                                row["sqrt_vhat_median"] = sqrt_v[sl].median().item()
                                row["eps_share"] = (v.abs() * eps_share[sl]).sum().item() / max(row["abs"], 1e-300)
                            tensor_rows.append(row)
                        rows += tensor_rows
                        total = sum(r["value"] for r in tensor_rows)
                        top = sorted(tensor_rows, key=lambda r: -abs(r["value"]))[:TOP]
                        entry["components"][c] = {"total": total, "top": [
                            {k: r[k] for k in ("tensor", "value", "scale_median", "sqrt_vhat_median", "eps_share")}
                            for r in top]}
                    entry["full"] = sum(v["total"] for v in entry["components"].values())
                    entry["residual"] = entry["full"] - entry["change"] if reading != "sgd" or own == "sgd" else None
                    summary.append(entry)
    return rows, summary


def _step_rule(opt, model, moments):
    """The optimizer's step as a rule on moments (``advance``, ``scale``): Adam's (with the second moment before
    this step) or SGD's with momentum (plain SGD: momentum 0, so the moment is the gradient)."""
    group = opt.param_groups[0]
    no_sites = moments["full"].new_empty(0)  # m_sites, unused here: the breakdown advances its sites' moments itself
    if "betas" in group:
        v_prev, t = adam_second_moment(opt, list(model.parameters()))
        return AdamStep(v_prev, t, group["betas"], group["eps"], moments["full"], no_sites)
    return MomentumStep(group.get("momentum", 0.0), moments["full"], no_sites)


def _decay(cfg) -> float:
    """The factor by which a moment forgets one step: β1 (Adam) or the momentum."""
    return cfg.beta1 if cfg.optimizer == "adam" else cfg.momentum


def _sqrt_vhat(opt, model) -> torch.Tensor:
    """√v̂ [n_params] after the step just taken: Adam's bias-corrected second moment."""
    params = list(model.parameters())
    v, t = adam_second_moment(opt, params)  # t: the step about to be taken, so t − 1 were taken
    beta2 = opt.param_groups[0]["betas"][1]
    return (v / (1 - beta2 ** (t - 1))).sqrt()


def _path_gradients(model, theta, real, held, r_star, probes, points):
    """({(feature, site, mismatch): ∫₀¹ ∇R_H(θ − sΔ) ds [n_params]}, {same: R_H(θ) − R_H(θ − Δ)}) by the
    ``points``-point Gauss–Legendre rule and autograd, on the readout ``held`` with θ*'s residuals ``r_star``."""
    scratch = copy.deepcopy(model)
    params = list(scratch.parameters())
    sizes = [p.numel() for p in params]

    def set_to(x):
        with torch.no_grad():
            for q, b in zip(params, x.split(sizes)):
                q.copy_(b.view_as(q))

    def risks(keep_graph):
        resid = scratch(held, return_resid=True, myopic="none")[1]
        out = {}
        for p in probes:
            k, i = p.site.layer, p.site.pos
            d = (resid[k][:, i] - r_star[k][:, i]).double() @ p.w.double().to(resid[k].device)
            for m in MISMATCHES:
                out[p.name, p.site, m] = mismatch_value(d, m)
        return out if keep_graph else {k: v.item() for k, v in out.items()}

    grads: dict = {}
    for s, w in gauss_legendre(points):
        set_to(theta - s * real)
        values = risks(True)
        for key, value in values.items():
            g = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
            grads[key] = grads.get(key, 0.0) + w * flat_grads(g, params).to(theta.dtype)
    with torch.no_grad():
        set_to(theta)
        r0 = risks(False)
        set_to(theta - real)
        r1 = risks(False)
    return grads, {k: r0[k] - r1[k] for k in r0}


def breakdown_lines(summary: list[dict]) -> list[str]:
    """Per step, site, feature and reading of R_c: the components' totals and each one's largest tensors."""
    lines = []
    for e in summary:
        if e["mismatch"] != "centred":
            continue
        comps = "; ".join(
            f"{c} {v['total']:+.3g} (" + ", ".join(
                f"{t['tensor']} {t['value']:+.2g}" + (f" ε-share {t['eps_share']:.2f}" if t["eps_share"] is not None
                                                       else "") for t in v["top"]) + ")"
            for c, v in e["components"].items())
        lines.append(f"step {e['step']} {e['layer']}:{e['pos']} {e['feature']} R_c [{e['reading']}]: {comps}; "
                     f"change {e['change']:+.3g}")
    return lines
