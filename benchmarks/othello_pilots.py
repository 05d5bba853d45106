"""Pilots for the medium Othello scale (issue 32): learning curves of candidate configurations on one CPU thread.

Each pilot trains its configuration (a TrainConfig planned for its full length, warmup + cosine decay, one epoch of
fresh games) for a wall-time budget, then fits the ridge board probes on its checkpoints. Its curve: legal-move
accuracy (top-1 legal, the run's evaluations) and the probe r of useful / useless squares by layer (mean over
positions 1..60, then over squares, as ``othello_report``'s probe_by_layer) against games seen.

Usage (one core, in the background; each stage resumes):
    OMP_NUM_THREADS=1 python benchmarks/othello_pilots.py train NAME --out DIR --minutes 7
    OMP_NUM_THREADS=1 python benchmarks/othello_pilots.py probe NAME --out DIR [--every 500]
    python benchmarks/othello_pilots.py summary --out DIR        # DIR/curves.json, printed
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ntpflow.files import write_json
from ntpflow.probes import ProbeSet
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run
from ntpflow.runs.training import train

BASE = {"task": "othello", "n_head": 4, "batch_size": 256, "lr": 1e-3, "warmup": 200, "decay": "cosine",
        "final_lr_frac": 0.1, "n_eval": 2048, "eval_every": 50, "ckpt_every": 100, "log_every": 50, "device": "cpu"}
# steps: about 3 core-hours at the throughputs measured in issue 32 (one epoch of fresh games, n_train = steps x batch)
PILOTS = {
    "L4_d128": {"n_layer": 4, "d_model": 128, "steps": 5900},
    "L4_d96": {"n_layer": 4, "d_model": 96, "steps": 9400},
    "L3_d128": {"n_layer": 3, "d_model": 128, "steps": 7600},
    # the 6x6 fallback (scale medium-6x6; NOT the paper's setting): planned for 6000 steps, evaluated every 100
    "six_L4_d128": {"n_layer": 4, "d_model": 128, "steps": 6000, "board_size": 6, "eval_every": 100},
}


def config(name: str) -> TrainConfig:
    p = {**BASE, **PILOTS[name]}
    return TrainConfig(**p, n_train=p["steps"] * p["batch_size"])


def cmd_train(name: str, out: Path, minutes: float) -> None:
    """Train until ``minutes`` of this process's CPU time are spent (SIGPROF stops it; the checkpoints stay): on a
    shared machine a wall-time budget would measure the load, not the configuration."""
    torch.set_num_threads(1)

    def stop(*_):
        raise TimeoutError

    signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, minutes * 60)
    t0, c0 = time.time(), time.process_time()
    try:
        train(config(name), out / name, progress=False)
    except TimeoutError:
        pass
    write_json(out / name / "pilot_wall.json", {"wall_s": time.time() - t0, "cpu_s": time.process_time() - c0,
                                                "cpu_minutes_budget": minutes})


def _layer_means(ps: ProbeSet, typ: int) -> list[float]:
    """Mean over squares of the per-square mean over positions of the test r of squares of type ``typ``."""
    r = ps.r_by_type[typ].double().numpy()  # [L+1, P, F]
    with np.errstate(all="ignore"):
        per_sq = np.nanmean(r, axis=1)  # [L+1, F]
    return [float(np.nanmean(row)) for row in per_sq]


def cmd_probe(name: str, out: Path, every: int) -> None:
    torch.set_num_threads(1)
    run = Run.open(out / name)
    steps = sorted(s for s in run.checkpoints() if s % every == 0)
    for s in ["init", *steps]:
        load_or_probe(run, s, "cpu")


def cmd_summary(out: Path) -> dict:
    curves = {}
    for name in PILOTS:
        if not (out / name / "config.json").exists():
            continue
        run = Run.open(out / name)
        cfg = run.cfg
        evals = [m for m in run.metrics() if m["kind"] == "eval"]
        probes = []
        for s in [0, *sorted(run.checkpoints())]:  # 0: the step-0 weights (probes_init)
            if ProbeSet.saved(run.probes_dir(s or "init")):
                ps = ProbeSet.load(run.probes_dir(s or "init"))
                probes.append({"step": s, "games": s * cfg.batch_size, "useful_r": _layer_means(ps, 2),
                               "useless_r": _layer_means(ps, 1)})
        wall = json.loads((out / name / "pilot_wall.json").read_text()) if (out / name / "pilot_wall.json").exists() else {}
        last = evals[-1]["step"] if evals else 0
        curves[name] = {
            "config": {k: v for k, v in cfg.to_dict().items() if k in (*BASE, "n_layer", "d_model", "steps")},
            "wall_s": wall.get("wall_s"), "steps_done": last,
            "games_per_core_hour": None if not wall else round(last * cfg.batch_size / wall["cpu_s"] * 3600),
            "eval": [{"step": m["step"], "games": m["step"] * cfg.batch_size, "legal_acc": m["legal_acc"],
                      "eval_loss": m["eval_loss"]} for m in evals],
            "probes": probes,
        }
    write_json(out / "curves.json", {"curves": curves, "extrapolation": extrapolate(curves)})
    return curves


def power_fit(games, value, start: int) -> dict | None:
    """Least-squares fit of log(1 - value) = a + b log(games) on the points from ``games >= start``: the error
    ``1 - value`` as a power law of the games seen. None with fewer than 3 points."""
    pts = [(g, v) for g, v in zip(games, value) if g >= start and v is not None and v < 1]
    if len(pts) < 3:
        return None
    x, y = np.log([g for g, _ in pts]), np.log([1 - v for _, v in pts])
    b, a = np.polyfit(x, y, 1)
    return {"a": float(a), "b": float(b), "from_games": start, "n_points": len(pts)}


def predict(fit: dict | None, games: float) -> float | None:
    """The value ``1 - exp(a) games^b`` of a :func:`power_fit` at ``games``."""
    return None if fit is None else float(1 - math.exp(fit["a"]) * games ** fit["b"])


def extrapolate(curves: dict, core_hours: float = 3.0) -> dict:
    """Per pilot: the games trained in ``core_hours`` at its measured rate, and the power-law fits of the legal-move
    error and of the useful squares' probe error (1 - r, best middle layer) over the second half of its curve,
    evaluated there."""
    out = {}
    for name, c in curves.items():
        rate = c.get("games_per_core_hour")
        if not rate or not c["eval"]:
            continue
        budget = rate * core_hours
        ev = [e for e in c["eval"] if e["games"] > 0]
        half = ev[len(ev) // 2]["games"] if ev else 0
        legal = power_fit([e["games"] for e in ev], [e["legal_acc"] for e in ev], half)
        n_layer = c["config"]["n_layer"]
        middle = range(1, n_layer)  # resid[1..L-1]: outputs of the blocks before the last
        pr = [p for p in c["probes"] if p["games"] > 0]
        best = [max(p["useful_r"][k] for k in middle) for p in pr]
        half_p = pr[len(pr) // 2]["games"] if pr else 0
        probe = power_fit([p["games"] for p in pr], best, half_p)
        out[name] = {"games_per_core_hour": rate, "games_in_budget": round(budget), "legal_fit": legal,
                     "legal_at_budget": predict(legal, budget), "useful_r_fit": probe,
                     "useful_r_at_budget": predict(probe, budget),
                     "last": {"games": ev[-1]["games"] if ev else 0, "legal_acc": ev[-1]["legal_acc"] if ev else None,
                              "useful_r_best_middle": best[-1] if best else None}}
    return out


def figure(curves: dict, path: Path) -> None:
    """Legal-move accuracy and the useful / useless squares' probe r (best middle layer) against games seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, c in curves.items():
        line = a.plot([e["games"] for e in c["eval"]], [e["legal_acc"] for e in c["eval"]], marker="o", ms=3,
                      label=name)[0]
        middle = range(1, c["config"]["n_layer"])
        for key, ls in (("useful_r", "-"), ("useless_r", "--")):
            b.plot([p["games"] for p in c["probes"]], [max(p[key][k] for k in middle) for p in c["probes"]],
                   ls=ls, marker="o", ms=3, color=line.get_color(), label=f"{name} {key.split('_')[0]}")
    a.set(xlabel="games seen", ylabel="legal-move accuracy (top-1 legal)", title="legal moves")
    b.set(xlabel="games seen", ylabel="ridge r, best middle layer", title="board probes (useful -, useless --)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=("train", "probe", "summary"))
    ap.add_argument("name", nargs="?")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--every", type=int, default=100)
    a = ap.parse_args()
    if a.cmd != "summary" and a.name not in PILOTS:
        sys.exit(f"name must be one of {sorted(PILOTS)}")
    if a.cmd == "train":
        cmd_train(a.name, a.out, a.minutes)
    elif a.cmd == "probe":
        cmd_probe(a.name, a.out, a.every)
    else:
        figure(cmd_summary(a.out), a.out / "pilots.png")
        print(json.dumps(json.loads((a.out / "curves.json").read_text())["extrapolation"], indent=1))


if __name__ == "__main__":
    main()
