"""Where the first-order balance of an attribution goes: an exact audit of Σ influence against the mismatch removed.

The components' influences at a step add up to the full influence f_B = −⟨∇R_B(θ_t), Δθ_t⟩: the first-order change
of the mismatch R on the step's own training batch B_t, along the update actually taken, Δθ_t = θ_{t+1} − θ_t
(positive = toward the final value, as in ntpflow.engine.influence). Summed over training it is compared with the mismatch
removed on a fixed held-out set H, R_H(θ_0) − R_H(θ_T), which is Σ_t ΔR_H with ΔR_H = R_H(θ_t) − R_H(θ_{t+1}). The
audit replays the run and splits the difference exactly, step by step:

    Σ f_B − (R_H(θ_0) − R_H(θ_T)) = Σ (f_B − f_H)      same batch: R read on the batch the step was taken on
                                  + Σ (f_H − ΔR_H)     beyond first order on H

with f_H = −⟨∇R_H(θ_t), Δθ_t⟩. The first part is the correlation of a step with the batch it was taken on (it
vanishes in expectation only if R is read on data independent of the step); the second is the curvature of R_H
along the path and every higher order. Each f is one forward-mode derivative along Δθ_t (``forward_mode``), for all
probes and both mismatches (R and R_c) at once: about 3 forwards of B and of H per step besides the step itself.

Output folder (default ``RUN_DIR/balance``)::

    spec.json            sites, features, held-out size, the run's config hash
    state/step_NNNNNN.*  model, Adam and the running sums at a block boundary (resume point; the last two kept)
    summary.json         per probe and mismatch: the sums above and their cumulative curves every ``block`` steps
"""

import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from ntpflow.engine.forward_mode import Primals, all_tangents
from ntpflow.engine.influence import MISMATCHES, Probe, mismatch_value
from ntpflow.files import DirLock, ensure_writable_dir, read_json, resolve_device, stamp, write_json
from ntpflow.model.gpt import GPT
from ntpflow.model.sites import Site
from ntpflow.progress import progress_of
from ntpflow.replay.member import check_replay, resume_points, save_resume_point
from ntpflow.replay.tracked import check_features, make_probes, run_sites
from ntpflow.runs.data import DataOrder, to_torch
from ntpflow.runs.group import replay_stepper
from ntpflow.runs.run import AttributionDir, Run
from ntpflow.runs.threads import follow_threads
from ntpflow.runs.training import make_optimizer

log = logging.getLogger(__name__)
TERMS = ("full_batch", "full_held_out", "midpoint_batch", "midpoint_held_out", "removed_held_out")
TERM_DOCS = {"full_batch": "Σ_t −⟨∇R_B(θ_t), Δθ_t⟩ on each step's training batch (the tracker's full influence)",
             "full_held_out": "Σ_t −⟨∇R_H(θ_t), Δθ_t⟩ on the fixed held-out set H",
             "midpoint_batch": "Σ_t −⟨∇R_B(θ_t + Δθ_t/2), Δθ_t⟩: the gradient read at the step's midpoint",
             "midpoint_held_out": "Σ_t −⟨∇R_H(θ_t + Δθ_t/2), Δθ_t⟩",
             "removed_held_out": "R_H(θ_0) − R_H(θ_t), the mismatch removed on H",
             "same_batch": "full_batch − full_held_out",
             "beyond_first_order": "full_held_out − removed_held_out",
             "beyond_midpoint": "midpoint_held_out − removed_held_out (third order and above)"}


def directional_terms(model: GPT, direction: torch.Tensor, tokens: torch.Tensor, probes: Sequence[Probe],
                      final_proj: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every probe's mismatch at ``model``'s weights and its derivative along ``direction`` on ``tokens``.

    direction: flat [n_params] in ``model.parameters()`` order; tokens [batch, pos]; final_proj: ⟨w, r*⟩ of θ*
    [batch, n_probes]. Returns {mismatch: [2, n_probes]}: R and dR/dε of ε ↦ R(θ + ε·direction) at ε = 0 (the
    ordinary forward, residual index k = layer; positions after the last probed one are not computed).
    """
    upto = max(p.site.pos for p in probes) + 1
    primals = Primals(model, tokens[:, :upto])
    tangents = all_tangents(primals, max(p.site.layer for p in probes), upto, direction[None])
    d = torch.stack([primals.resid[p.site.layer][:, p.site.pos] @ p.w for p in probes], 1) - final_proj
    dd = torch.stack([tangents[p.site.layer][0, :, p.site.pos] @ p.w for p in probes], 1)  # [batch, n_probes]
    out = {}
    for mismatch in MISMATCHES:  # dR/dε = mean_b 2 e_b ė_b, e = d (R) or d − d̄ (R_c)
        x, dx = (v if mismatch == "paper" else v - v.mean(0) for v in (d, dd))
        out[mismatch] = torch.stack([mismatch_value(d, mismatch), 2 * (x * dx).mean(0)])
    return out


def _mismatches(model: GPT, tokens: torch.Tensor, probes: Sequence[Probe], final_proj: torch.Tensor) -> torch.Tensor:
    """[n_mismatch, n_probes]: R and R_c of every probe at ``model``'s weights on ``tokens``."""
    d = probe_projections(model, tokens, probes) - final_proj
    return torch.stack([mismatch_value(d, m) for m in MISMATCHES])


def probe_projections(model: GPT, tokens: torch.Tensor, probes: Sequence[Probe]) -> torch.Tensor:
    """⟨w, r^k_i⟩ [batch, n_probes] of every probe under ``model`` (ordinary forward) on ``tokens`` [batch, pos]."""
    resid = Primals(model, tokens[:, :max(p.site.pos for p in probes) + 1]).resid
    return torch.stack([resid[p.site.layer][:, p.site.pos] @ p.w for p in probes], 1)


def audit_balance(run_dir: str | Path, sites: Sequence[Site], features: Sequence[str] | None = None, *,
                  out_dir: str | Path | None = None, n_held_out: int = 1024, device: str = "auto",
                  block: int | None = None, progress: bool = True) -> Path:
    """Replay the run at ``run_dir`` and split the gap between its integrated full influence and the mismatch
    removed on held-out data (see the module docstring) at ``sites`` × ``features``; returns the output folder.

    The replay must reproduce the run's final weights bit for bit, else RuntimeError. ``n_held_out`` examples of
    the eval set form H (the first ones: the set ``ntpflow attribute`` measures the mismatch removed on). It saves a
    resume point every ``block`` steps (default: the run's ``ckpt_every``) and resumes from it when interrupted.
    """
    run = Run.open(run_dir)
    if not run.done:
        raise ValueError(f"{run_dir} has not finished training; the audit replays a finished run")
    if n_held_out < 2:
        raise ValueError("n_held_out must be at least 2 (R_c is a variance)")
    cfg = run.cfg
    dev = resolve_device(device if device != "auto" else cfg.device)
    sites = run_sites(run, sites)
    check_features(run, features)  # before probes are fitted
    probes = [Probe(p.site, p.name, p.w.to(dev)) for p in make_probes(run, sites, features, device)]
    out = ensure_writable_dir(run.balance_dir(out_dir))
    folder = AttributionDir(out)
    with ExitStack() as locks:
        locks.enter_context(DirLock(out))
        spec = {"sites": [[s.layer, s.pos] for s in sites], "features": sorted({p.name for p in probes}),
                "n_held_out": n_held_out, "config_hash": cfg.hash(), "terms": list(TERMS)}
        if folder.spec.exists() and read_json(folder.spec) != spec:
            raise ValueError(f"{out} holds an audit of other sites/features/held-out size/terms; choose another --out")
        write_json(folder.spec, spec)
        if folder.summary.exists():
            return out
        train_set, eval_set = run.datasets()
        data = to_torch(train_set, dev)
        held = torch.as_tensor(eval_set.tokens[:n_held_out], device=dev)
        final = run.load_model("final", dev)
        held_star = probe_projections(final, held, probes)
        train_star = torch.cat([probe_projections(final, c, probes) for c in data["tokens"].split(256)])  # per example
        model, block = run.load_model("init", dev).train(), block or cfg.ckpt_every
        before = run.load_model("init", dev)  # θ_t while the model steps to θ_t+1
        middle = run.load_model("init", dev)  # θ_t + Δθ_t/2
        opt = make_optimizer(model, cfg)
        r0 = _mismatches(model, held, probes, held_star)  # [n_mismatch, n_probes]
        sums = torch.zeros(len(MISMATCHES), len(TERMS) - 1, len(probes), dtype=torch.float64, device=dev)
        curve = []
        start, state = resume_points(out).load_latest(model, opt, dev)
        if start:
            sums, curve = state["sums"], list(state["curve"].unbind(0))
            log.info("resuming the audit in %s from step %d", out, start)
        advance, order = replay_stepper(run, model, opt, dev), DataOrder(cfg.seed, cfg.n_train, cfg.batch_size)
        threads_at = locks.enter_context(follow_threads(run.dir, dev))
        for step in progress_of(range(start, cfg.steps), initial=start, total=cfg.steps, enabled=progress,
                                desc=f"balance {run.name}"):
            threads_at(step)
            i = order(step).to(dev)
            tokens, mask = data["tokens"][i], data["loss_mask"][i]
            with torch.no_grad():
                for b, p in zip(before.parameters(), model.parameters()):
                    b.copy_(p)
            advance(step, tokens, mask)
            with torch.no_grad():
                delta = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before.parameters())])
                for m, b, p in zip(middle.parameters(), before.parameters(), model.parameters()):
                    torch.lerp(b, p, 0.5, out=m)
                derivs = [directional_terms(at, delta, x, probes, star) for at in (before, middle)
                          for x, star in ((tokens, train_star[i]), (held, held_star))]
            for j, mismatch in enumerate(MISMATCHES):  # f = −dR/dε: positive moves toward θ*
                sums[j] -= torch.stack([d[mismatch][1] for d in derivs]).double()
            if (step + 1) % block == 0 or step + 1 == cfg.steps:
                removed = (r0 - _mismatches(model, held, probes, held_star)).double()
                curve.append(torch.cat([sums, removed[:, None]], 1))
                save_resume_point(out, model, opt, step + 1, {"sums": sums, "curve": torch.stack(curve)})
        check_replay(run, model)
        write_json(folder.summary, {**_summary(probes, curve, block, cfg.steps), "stamp": stamp()})
    return out


def _summary(probes: Sequence[Probe], curve: list[torch.Tensor], block: int, steps: int) -> dict:
    """Per probe and mismatch: the sums at the end, the parts of the gap, and their curves."""
    entries = []
    for j, mismatch in enumerate(MISMATCHES):
        for n, p in enumerate(probes):
            s = dict(zip(TERMS, curve[-1][j, :, n].tolist()))
            entries.append({"layer": p.site.layer, "pos": p.site.pos, "feature": p.name, "mismatch": mismatch, **s,
                            "same_batch": s["full_batch"] - s["full_held_out"],
                            "beyond_first_order": s["full_held_out"] - s["removed_held_out"],
                            "beyond_midpoint": s["midpoint_held_out"] - s["removed_held_out"],
                            "curve": {t: [c[j, k, n].item() for c in curve] for k, t in enumerate(TERMS)}})
    return {"probes": entries, "steps": steps, "curve_steps": [min((k + 1) * block, steps) for k in range(len(curve))],
            "terms": TERM_DOCS}
