"""Whole tracked replays of one toy run, side by side in one process: the exact account (the default of
``ntpflow attribute``: a readout set of 256 sequences, the adaptive Gauss–Legendre rule, refinement included) against
the replay read at each step's midpoint on its batch (``--midpoint``, what ``reproduce`` replayed before the exact
account), and the paper's reading (``--paper``) for reference; with ``--matrices`` also the exact account with the
influence matrices, if this version has them.

A run is trained first (untimed; the paper's toy model: majority, 2 layers, d_model 128, batch 256, Adam 1e-3, with
as many epochs as the medium scale; its probes fitted); then each round replays every variant into a fresh folder, the order rotating between rounds; medians
over rounds. Both the process's CPU time and the wall time are printed; on a machine shared with other jobs the CPU
time (one torch thread by default) is the steadier measure. Each exact replay's residuals (largest |residual| /
R_H(θ_0) per mismatch) and refined steps come from its summary.json.

    python benchmarks/bench_exact_account.py                      # 60 steps, sites 1:4,1:6,1:8,1:14, 2 rounds
    python benchmarks/bench_exact_account.py --sites 1-2:2-19 --steps 100 --rounds 3
    python benchmarks/bench_exact_account.py --steps 3000 --rounds 1 --skip-paper   # a whole medium-length run
    python benchmarks/bench_exact_account.py --batch 64 --readout 64,256 --skip-paper   # cost against readout / batch
"""

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ntpflow.model.sites import parse_sites
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.training import train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="majority", help="majority (default) or cond_majority")
    p.add_argument("--steps", type=int, default=60, help="training steps of the replayed run (default 60)")
    p.add_argument("--sites", default="1:4,1:6,1:8,1:14", help="tracked sites (default: the toy medium scale's)")
    p.add_argument("--readout", default="256", help="the exact account's readout set; a comma-separated list times "
                   "one exact replay per size (default 256)")
    p.add_argument("--batch", type=int, default=256, help="the run's batch size (default 256, the paper's)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--matrices", action="store_true", help="also time the exact account with influence matrices")
    p.add_argument("--skip-paper", action="store_true", help="leave out the paper's reading (long runs)")
    p.add_argument("--root", help="folder for the run and the replays (default: a temporary one)")
    return p.parse_args(argv)


def variants(args) -> dict[str, dict]:
    """{name: attribute options} of the timed replays (Adam rows only, as the experiments replay)."""
    sizes = [int(x) for x in str(args.readout).split(",")]
    out = {"midpoint": {"reading": "midpoint"}, "paper": {"reading": "paper"}}
    out |= {("exact" if len(sizes) == 1 else f"exact@{n}"): {"reading": "exact", "readout": n} for n in sizes}
    if args.skip_paper:
        del out["paper"]
    if args.matrices:
        if "matrices" not in inspect.signature(attribute).parameters:
            raise SystemExit("this version of attribute has no influence matrices (--matrices)")
        out["exact+matrices"] = {"reading": "exact", "readout": sizes[0], "matrices": True}
    return out


def worst_residuals(summary: dict) -> str:
    """The largest |residual| / R_H(θ_0) per mismatch, and the refined steps, of an exact replay's summary."""
    parts = []
    for mismatch in ("paper", "centred"):
        rows = [e for e in summary["probes"] if e["mismatch"] == mismatch and "residual" in e]
        if rows:
            parts.append(f"{mismatch} {max(abs(e['residual']) / e['R0_eval'] for e in rows):.2e}")
    return ", ".join(parts) + f"; refined {summary['refined_steps']}/{summary['steps']} steps"


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        # as many epochs as the medium scale's 3000 steps over 102,400 sequences (7.5), so that the batch readings'
        # θ* projection cache (filled on each example's first use) costs per step what it costs in a real replay
        readouts = [int(x) for x in str(args.readout).split(",")]
        cfg = TrainConfig(task=args.task, steps=args.steps, batch_size=args.batch,
                          n_train=max(args.batch, round(args.steps * args.batch / 7.5)),
                          n_eval=max(1024, *readouts), eval_every=args.steps, ckpt_every=args.steps, device="cpu")
        run = train(cfg, root / "run", progress=False)
        load_or_probe(run, "final", "cpu")
        sites = parse_sites(args.sites)
        feature = run.task.feature_names[0]
        kinds = variants(args)
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        wall: dict[str, list[float]] = {k: [] for k in kinds}
        notes: dict[str, str] = {}
        names = list(kinds)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                out = root / f"{name}-{r}"
                c0, w0 = time.process_time(), time.perf_counter()
                attribute(run.dir, AttributionSpec(sites, [feature], sgd_rows=False, **kinds[name]), out_dir=out,
                          device="cpu", progress=False)
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
                if name.startswith("exact"):
                    notes[name] = worst_residuals(json.loads((out / "summary.json").read_text()))
                print(f"  round {r + 1}/{args.rounds}: {name} {wall[name][-1]:.1f} s", flush=True)
    base_cpu, base_wall = statistics.median(cpu["midpoint"]), statistics.median(wall["midpoint"])
    print(f"\nwhole replays of {args.task}, {args.steps} steps, {len(sites)} sites × 1 feature ({feature}), Adam rows, "
          f"batch {args.batch}, readout {args.readout}, {args.threads} thread(s), medians of {args.rounds} rounds")
    print("| replay | CPU s | / midpoint | wall s | / midpoint | residuals (exact) |")
    print("|---|---:|---:|---:|---:|---|")
    for name in kinds:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"| {name} | {c:.1f} | {c / base_cpu:.2f}x | {w:.1f} | {w / base_wall:.2f}x | {notes.get(name, '')} |")


if __name__ == "__main__":
    main()
