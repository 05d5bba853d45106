"""Tracked replays of a run group, side by side in one run: its R members one by one (``attribute`` per member, each
stepping the whole group), one replay of the group that tracks the members one after another
(``attribute_group(run_axis=False)``), and one that tracks them in one vmapped pass over the run axis (the default,
``ntpflow.engine.run_axis``).

Per R: a group of R runs is trained first (untimed, with its probes); then each round times the variants on fresh
output folders, the order rotating between rounds; medians over rounds. Both the process's CPU time and the wall
time are reported: on a machine shared with other jobs the CPU time (one torch thread by default, so that no thread
spins waiting for another) is the steadier measure. The member-by-member group replay must write the same bytes as
the one-by-one replays; the run-axis one the same rows with values equal to rounding (the largest difference,
relative to the largest |value|, is printed). Expected: one by one costs R·(track + group step) per replayed step,
member by member R·track + one group step, the run axis one batched track (R members' work, each kernel launched
once) + one group step.

    python benchmarks/bench_group_replay.py                       # R = 2, 4 at d_model 64, 2 sites, 8 steps
    python benchmarks/bench_group_replay.py --d-model 128 --batch 256 --sites 1:5,1:12   # the toy architecture
    python benchmarks/bench_group_replay.py --device cuda --runs 1,10,40 --d-model 128 --batch 256 --sites 1-2:2-19
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ntpflow.model.sites import parse_sites
from ntpflow.replay.attribution import attribute, attribute_group
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.group import train_group
from ntpflow.runs.probe import load_or_probe


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="2,4", help="comma-separated R values (default 2,4)")
    p.add_argument("--steps", type=int, default=8, help="training (and replayed) steps (default 8)")
    p.add_argument("--d-model", type=int, default=64, help="d_model (default 64; the toy architecture: 128)")
    p.add_argument("--batch", type=int, default=64, help="batch size per run (default 64; the toy's: 256)")
    p.add_argument("--sites", default="1:5,1:12", help="tracked sites (default 1:5,1:12; the paper's: 1-2:2-19)")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return p.parse_args(argv)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def parquet_values(folders: list[Path]) -> tuple[list[dict], torch.Tensor]:
    """The rows of the members' influence.parquet without their values, and the values [rows] (float64)."""
    import pyarrow.parquet as pq

    rows = [r for f in folders for r in pq.read_table(f / "influence.parquet").to_pylist()]
    values = torch.tensor([r["value"] for r in rows], dtype=torch.float64)
    return [{k: v for k, v in r.items() if k not in ("value", "cumulative")} for r in rows], values


VARIANTS = ("one by one", "member by member", "run axis")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    Rs = [int(x) for x in args.runs.split(",")]
    sites, features = parse_sites(args.sites), ["is_majority_<0>"]
    settings = dict(task="majority", steps=args.steps, d_model=args.d_model, batch_size=args.batch,
                    n_train=args.batch * 20, n_eval=512, eval_every=args.steps, ckpt_every=max(1, args.steps // 2),
                    device=args.device)
    print(f"group-replay benchmark  {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {args.device}, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"majority, vanilla: n_layer 2, d_model {args.d_model}, batch {args.batch} per run, {args.steps} steps, "
          f"sites {args.sites} x {features}; R = {Rs}; rounds {args.rounds}")
    load0 = os.getloadavg()
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for R in Rs:
            root = Path(tmp) / f"R{R}"
            runs = train_group([TrainConfig(seed=s, **settings) for s in range(R)],
                               [root / f"s{s}" for s in range(R)], progress=False)
            for run in runs:
                load_or_probe(run, "final", args.device)
            dirs = [run.dir for run in runs]
            times = {kind: [] for kind in VARIANTS}  # (CPU s, wall s) per round
            for i in range(args.rounds):
                outs = {kind: [root / f"v{j}-{i}-{r}" for r in range(R)] for j, kind in enumerate(VARIANTS)}
                for kind in VARIANTS[i % 3:] + VARIANTS[:i % 3]:
                    c0, t0 = time.process_time(), time.perf_counter()
                    if kind == "one by one":
                        for run, out in zip(runs, outs[kind]):
                            attribute(run.dir, AttributionSpec(sites, features),
                                      out_dir=out, device=args.device, progress=False)
                    else:
                        attribute_group(dirs, AttributionSpec(sites, features), out_dirs=outs[kind],
                                        device=args.device, progress=False, run_axis=kind == "run axis")
                    times[kind].append((time.process_time() - c0, time.perf_counter() - t0))
                if [tree(o) for o in outs["member by member"]] != [tree(o) for o in outs["one by one"]]:
                    print(f"R = {R}: the member-by-member replay wrote other files than the one-by-one replays",
                          file=sys.stderr)
                    return 1
                (want, a), (got, b) = parquet_values(outs["one by one"]), parquet_values(outs["run axis"])
                if got != want:
                    print(f"R = {R}: the run-axis replay wrote other rows", file=sys.stderr)
                    return 1
                worst = max(worst, ((b - a).abs().max() / a.abs().max()).item())
            rows.append((R, {kind: [statistics.median(t[j] for t in times[kind]) for j in (0, 1)]
                             for kind in VARIANTS}))
    print("\noutputs: the member-by-member replay's folders equal the one-by-one folders byte for byte; the run-axis "
          f"replay's rows are the same, values within {worst:.1e} of the largest |value| (every R, every round)\n")
    head = "  ".join(f"{k + ' ' + u:>24}" for u in ("CPU s", "wall s") for k in VARIANTS)
    print(f"{'R':>3}  {head}  {'1-by-1 / run axis (CPU)':>24}  {'member / run axis (CPU)':>24}  "
          f"{'1-by-1 / run axis (wall)':>25}")
    for R, t in rows:
        cells = "  ".join(f"{t[k][j]:>24.1f}" for j in (0, 1) for k in VARIANTS)
        ax = t["run axis"]
        print(f"{R:>3}  {cells}  {t['one by one'][0] / ax[0]:>23.2f}x  {t['member by member'][0] / ax[0]:>23.2f}x  "
              f"{t['one by one'][1] / ax[1]:>24.2f}x")
    print(f"\nload average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, "
          f"at end {tuple(round(x, 2) for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
