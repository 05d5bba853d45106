"""Tracked replays of a run group: its R members one by one (``attribute`` per member, each stepping the whole group)
against one replay of the group that tracks all R (``attribute_group``), side by side in one run.

Per R: a group of R runs is trained first (untimed, with its probes); then each round times both variants on fresh
output folders, the order alternating between rounds; medians over rounds. Both the process's CPU time and the wall
time are reported: on a machine shared with other jobs the CPU time (one torch thread by default, so that no thread
spins waiting for another) is the steadier measure. The two variants' output folders are
compared file by file (they must be the same bytes). Expected saving: one by one costs R·(track + group step), the
group replay R·track + one group step, per replayed step.

    python benchmarks/bench_group_replay.py                       # R = 2, 4 at d_model 64, 2 sites, 8 steps
    python benchmarks/bench_group_replay.py --d-model 128 --batch 256 --sites 1:5,1:12   # the toy architecture
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

from ntpflow.config import TrainConfig
from ntpflow.probe_runs import load_or_probe
from ntpflow.replay import attribute, attribute_group
from ntpflow.run_group import train_group
from ntpflow.sites import parse_sites


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="2,4", help="comma-separated R values (default 2,4)")
    p.add_argument("--steps", type=int, default=8, help="training (and replayed) steps (default 8)")
    p.add_argument("--d-model", type=int, default=64, help="d_model (default 64; the toy architecture: 128)")
    p.add_argument("--batch", type=int, default=64, help="batch size per run (default 64; the toy's: 256)")
    p.add_argument("--sites", default="1:5,1:12", help="tracked sites (default 1:5,1:12; the paper's: 1-2:2-19)")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    return p.parse_args(argv)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    Rs = [int(x) for x in args.runs.split(",")]
    sites, features = parse_sites(args.sites), ["is_majority_<0>"]
    settings = dict(task="majority", steps=args.steps, d_model=args.d_model, batch_size=args.batch,
                    n_train=args.batch * 20, n_eval=512, eval_every=args.steps, ckpt_every=max(1, args.steps // 2),
                    device="cpu")
    print(f"group-replay benchmark  {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, cpu, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"majority, vanilla: n_layer 2, d_model {args.d_model}, batch {args.batch} per run, {args.steps} steps, "
          f"sites {args.sites} x {features}; R = {Rs}; rounds {args.rounds}")
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for R in Rs:
            root = Path(tmp) / f"R{R}"
            runs = train_group([TrainConfig(seed=s, **settings) for s in range(R)],
                               [root / f"s{s}" for s in range(R)], progress=False)
            for run in runs:
                load_or_probe(run, "final", "cpu")
            times = {"one by one": [], "group": []}  # (CPU s, wall s) per round
            for i in range(args.rounds):
                outs = {kind: [root / f"{kind[0]}{i}-{r}" for r in range(R)] for kind in times}
                order = list(times) if i % 2 == 0 else list(times)[::-1]
                for kind in order:
                    c0, t0 = time.process_time(), time.perf_counter()
                    if kind == "group":
                        attribute_group([run.dir for run in runs], sites, features, out_dirs=outs[kind],
                                        device="cpu", progress=False)
                    else:
                        for run, out in zip(runs, outs[kind]):
                            attribute(run.dir, sites, features, out_dir=out, device="cpu", progress=False)
                    times[kind].append((time.process_time() - c0, time.perf_counter() - t0))
                if [tree(o) for o in outs["group"]] != [tree(o) for o in outs["one by one"]]:
                    print(f"R = {R}: the two variants wrote different files", file=sys.stderr)
                    return 1
            rows.append((R, *(statistics.median(t[j] for t in times[kind]) for kind in times for j in (0, 1))))
    print("\noutputs: the group replay's folders equal the one-by-one folders byte for byte (every R, every round)\n")
    print(f"{'R':>3} {'one by one CPU s':>17} {'group CPU s':>12} {'ratio (CPU)':>12} {'one by one wall s':>18} "
          f"{'group wall s':>13} {'ratio (wall)':>13}")
    for R, sep_cpu, sep, grp_cpu, grp in rows:
        print(f"{R:>3} {sep_cpu:>17.1f} {grp_cpu:>12.1f} {sep_cpu / grp_cpu:>11.2f}x {sep:>18.1f} {grp:>13.1f} "
              f"{sep / grp:>12.2f}x")
    print(f"\nload average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, "
          f"at end {tuple(round(x, 2) for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
