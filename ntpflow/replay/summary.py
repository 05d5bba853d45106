"""An attribution's closing: influence.parquet (every part's rows, self-describing), summary.json (per probe and
mismatch: each reading's totals, the change, the residual, κ and the shares) and the closing log lines."""

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from ntpflow.engine.influence import MISMATCHES, Readout, mismatch_value
from ntpflow.files import (
    stamp,
    write_json,
)
from ntpflow.replay.answer import shares, useful_flag
from ntpflow.replay.conditioning import condition, conditioning_lines, step_kappas
from ntpflow.runs.run import AttributionDir, Run

log = logging.getLogger(__name__)


def exact_notes(counted, ro: Readout) -> dict:
    """The exact account's counters and rule (summary.json) of a replay: ``counted`` its tracker or account
    (``refined``, ``subdivided``, ``evaluations``), ``ro`` its readout rule."""
    return {"refined_steps": counted.refined, "subdivided_steps": counted.subdivided,
            "point_evaluations": counted.evaluations,
            "rule": f"Gauss-Legendre {'/'.join(map(str, ro.levels))} points, then the step split into "
                    f"{'/'.join(map(str, ro.pieces)) or 'no'} pieces of {ro.levels[-1]} points each, a step "
                    f"re-integrated while |residual| > min({ro.rtol:g} |change|, {ro.cap:g} R_H(θ_0)) + "
                    f"{ro.floor:g} R_H(θ_0), each split after the first kept only if it cuts the worst excess by "
                    f"{ro.stall:g}"}


def write_summary(out: Path, run: Run, probes, final_model, eval_set, dev, readout: int | None = None,
            exact: dict | None = None):
    """Write influence.parquet (the parts' rows, self-describing) and summary.json; log the closing lines.
    ``exact``: the exact account's counters and rule (:func:`exact_notes`), with ``readout``."""
    folder = AttributionDir(out)
    parts = folder.part_files()
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    for name, value, kind in (("task", run.cfg.task, pa.string()), ("regime", run.cfg.regime, pa.string()),
                              ("seed", run.cfg.seed, pa.int64())):  # self-describing rows: tables of runs combine
        table = table.append_column(name, pa.array([value] * table.num_rows, kind))
    flags = {(p.site.pos, p.name): useful_flag(run.task, p.site.pos, p.name) for p in probes}
    table = table.append_column("useful", pa.array([flags.get((pos, f)) for pos, f in zip(
        table["pos"].to_pylist(), table["feature"].to_pylist())], pa.bool_()))
    tmp = folder.influence.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    # mismatch actually removed, on a fixed held-out batch (the readout set, if any): R(θ_0) − R(θ_T) = R(θ_0), since
    # θ_T is θ* (the replay was checked bit for bit against the final weights before this)
    tokens = torch.as_tensor(eval_set.tokens[:readout or 1024], device=dev)
    with torch.no_grad():
        r_star = final_model(tokens, return_resid=True, myopic="none")[1]
        r0 = run.load_model("init", dev)(tokens, return_resid=True, myopic="none")[1]
    last = table.filter(pc.equal(table["step"], pc.max(table["step"]))).to_pylist()  # pyright: ignore[reportAttributeAccessIssue]  # pyarrow.compute's functions are generated at import, not in its stubs
    steps, own = step_kappas(table), run.cfg.own_rows
    summary = []
    for p in probes:
        k, i = p.site.layer, p.site.pos
        w = p.w.to(dev)
        d0 = (r0[k][:, i] - r_star[k][:, i]) @ w  # [batch]
        for mismatch in MISMATCHES:
            R0 = mismatch_value(d0, mismatch).item()
            entry = {"layer": k, "pos": i, "feature": p.name, "mismatch": mismatch, "useful": flags[(i, p.name)],
                     "R0_eval": R0,
                     "R0_minus_RT_eval": R0, "offset_share_R0": (d0.mean().pow(2) / d0.pow(2).mean()).item()}
            for r in last:
                if (r["layer"], r["pos"], r["feature"], r["feature_type"], r["mismatch"]) != (k, i, p.name, -1, mismatch):
                    continue
                if r["component"] in ("change", "residual"):  # readout: Σ exact changes, Σ residuals
                    entry[r["component"]] = r["cumulative"]
                elif r["component"] != "risk":
                    entry[f"{r['optimizer']}_{r['component']}"] = r["cumulative"]
            entry.update(condition(entry, steps, (k, i, p.name, -1, mismatch), own))
            entry["shares"] = shares(entry, own)
            summary.append(entry)
    extra = {} if readout is None else {
        "readout": readout, **(exact or {}),
        "exact": "R0_eval = R_H(θ_0) and R0_minus_RT_eval on the readout set; change = Σ_t R_H(θ_t) − R_H(θ_t+1); "
                 "residual = Σ_t (full influence − change)"}
    write_json(folder.summary, {"probes": summary, "steps": run.cfg.steps, "own_rows": own, **extra,
                                "conditioning": "kappa_o = (|o_direct| + |o_pre_cached| + |o_shared|) / |o_full| "
                                                "of reading o; kappa_steps_o the same summed over the steps' own "
                                                "values; signs_agree: the run's own reading and sgd per component",
                                "stamp": stamp(),
                                      "sign": "positive = the component moved the feature toward its final value"})
    tmp.replace(folder.influence)
    what = (f"{run.name}: attributed {len({p.site for p in probes})} sites × {len({p.name for p in probes})} features over "
            f"{run.cfg.steps} steps")
    if readout is None:
        log.info(f"{what}; {balance_text(summary, own)}")
        for line in conditioning_lines(summary, own):
            log.info(f"{run.name}: {line}")
        return
    exact = exact or {}
    log.info(f"{what} with the exact account on a readout of {readout}"
             f"{' (kept while training: no replay)' if exact.get('account') else ''}; {exact['refined_steps']}/"
             f"{run.cfg.steps} steps refined ({exact['subdivided_steps']} split into pieces); "
             f"{balance_text(summary, own, 'change')}")
    for line in residual_lines(summary) + conditioning_lines(summary, own):
        log.info(f"{run.name}: {line}")


def residual_lines(summary: list[dict], limit: float = 0.01) -> list[str]:
    """One line per mismatch of an exact account: the largest |residual| / R_H(θ_0) over its rows and PASS/FAIL
    against ``limit`` (the influence claims' precondition), as :func:`residual_share` decides it: a row with
    R_H(θ_0) = 0 and no residual (a feature constant on the readout) has nothing to split and is counted aside; one
    with R_H(θ_0) = 0 but a residual fails."""
    lines = []
    for mismatch in MISMATCHES:
        rows = [e for e in summary if e["mismatch"] == mismatch]
        share = residual_share(rows)
        if share is None:
            continue
        worst, zero = share["worst"], share["zero_R0"]
        ok = zero == 0 and worst is not None and worst <= limit
        empty = sum(1 for e in rows if e.get("residual") == 0 and e.get("R0_eval") == 0)
        notes = ([f"{zero} rows with R_H(θ_0) = 0 but a residual"] if zero else []) + (
            [f"{empty} rows with R_H(θ_0) = 0 and no residual, nothing to split"] if empty else [])
        lines.append(f"exact account, {mismatch}: largest |residual| / R_H(θ_0) "
                     f"{'n/a' if worst is None else f'{worst:.2e}'} {'PASS' if ok else 'FAIL'} (≤ {limit:g})"
                     + (f"; {'; '.join(notes)}" if notes else ""))
    return lines


def residual_share(records) -> dict | None:
    """The exact account's check over ``records`` (attribution summary rows with ``residual`` = Σ_t (full influence −
    exact change) and ``R0_eval`` = R_H(θ_0)): ``{"worst": the largest |residual| / R_H(θ_0), "n": rows, "zero_R0":
    rows with R_H(θ_0) = 0 and a non-zero residual}``; None when no row has a residual (the paper's reading)."""
    rows = [r for r in records if r.get("residual") is not None and r.get("R0_eval") is not None]
    if not rows:
        return None
    ratios = [abs(r["residual"]) / r["R0_eval"] for r in rows if r["R0_eval"] > 0]
    return {"worst": max(ratios, default=None), "n": len(rows),
            "zero_R0": sum(1 for r in rows if r["R0_eval"] <= 0 and r["residual"] != 0)}


def balance_text(summary: list[dict], own: str = "adam", removed: str = "R0_minus_RT_eval") -> str:
    """The balance check: the integrated full influence of the run's own reading against the mismatch removed,
    R(θ_0) − R(θ_T) on held-out data (the paper's readings: equal to first order only) or the summed exact changes
    (``removed="change"``: equal up to the residual), as a median over the probes."""
    ratios = sorted(e[f"{own}_full"] / e[removed] for e in summary
                    if e["mismatch"] == "paper" and f"{own}_full" in e and e.get(removed))
    what = "R(θ_0) − R(θ_T) on held-out data" if removed == "R0_minus_RT_eval" else "the exact change"
    return (f"integrated full influence / ({what}): median {ratios[len(ratios) // 2]:.3g} over {len(ratios)} probes "
            f"(1 = balanced)" if ratios else "balance check: no probe with a nonzero mismatch removed")

