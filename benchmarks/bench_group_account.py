"""A run group keeping its members' exact accounts while it trains (``train_group(..., accounts=...)``, what
``reproduce toy`` does at the grouped scales) against the group trained plainly and then replayed (one replay of the
group over the run axis, ``attribute_group``: what it did before), side by side in one process, the order rotating
between rounds.

Per R, each round times into fresh folders: plain group training; its replay (every member tracked, the exact
account on ``--readout`` sequences); group training with every member's account, followed by ``attribute_group``,
which reads the accounts (no replay). The final probes are fitted after training, timed with it. Printed: medians of the
process's CPU time (one torch thread; steadier than wall time on a shared machine) and of wall time, the ratios
kept / (plain + replay) (the pass saved) and kept / plain (the accounts' own cost), and the largest difference
between the two attributions' rows (summary.json totals, relative to the largest |value|: the account and the replay
integrate each step to the same tolerance, not the same bits).

    python benchmarks/bench_group_account.py                    # R = 2, 4 at d_model 64, batch 64, 2 sites, 16 steps
    python benchmarks/bench_group_account.py --d-model 128 --batch 256 --runs 2 --steps 8   # the toy architecture
"""

import argparse
import json
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
from ntpflow.replay.attribution import attribute_group
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import AccountSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.group import train_group
from ntpflow.runs.probe import load_or_probe

VARIANTS = ("plain", "replay", "kept")  # plain training; the replay of it; training with the accounts + reading


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="2,4", help="comma-separated R values (default 2,4)")
    p.add_argument("--steps", type=int, default=16, help="training steps (default 16)")
    p.add_argument("--d-model", type=int, default=64, help="d_model (default 64; the toy architecture: 128)")
    p.add_argument("--batch", type=int, default=64, help="batch size per run (default 64; the toy's: 256)")
    p.add_argument("--readout", type=int, default=0, help="readout sequences (default 0: the batch)")
    p.add_argument("--sites", default="1:5,1:12", help="tracked sites (default 1:5,1:12)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return p.parse_args(argv)


def totals(folders: list[Path]) -> torch.Tensor:
    """Every member's summary.json totals (change and each row's integrated influence), float64."""
    keys = ("change", "adam_direct", "adam_pre_cached", "adam_shared", "adam_full", "sgd_direct", "sgd_full")
    return torch.tensor([p[k] for f in folders for p in json.loads((f / "summary.json").read_text())["probes"]
                         for k in keys], dtype=torch.float64)


def timed(fn) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    Rs = [int(x) for x in args.runs.split(",")]
    sites, features = parse_sites(args.sites), ["is_majority_<0>"]
    readout = args.readout or args.batch
    settings = dict(task="majority", steps=args.steps, d_model=args.d_model, batch_size=args.batch,
                    n_train=args.batch * 20, n_eval=max(512, readout), eval_every=args.steps,
                    ckpt_every=max(1, args.steps // 2), device=args.device)
    spec = AttributionSpec(sites, features, readout=readout)
    account = AccountSpec(tuple(sites), readout, chunks=max(1, args.steps // 4))
    print(f"group-account benchmark  {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {args.device}, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"majority, vanilla: n_layer 2, d_model {args.d_model}, batch {args.batch} per run, {args.steps} steps, "
          f"readout {readout}, sites {args.sites} x {features}; R = {Rs}; rounds {args.rounds}")
    load0 = os.getloadavg()
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for R in Rs:
            cfgs = [TrainConfig(seed=s, **settings) for s in range(R)]
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in VARIANTS}
            for i in range(args.rounds):
                root = Path(tmp) / f"R{R}-{i}"
                plain, kept = ([root / f"{kind}{s}" for s in range(R)] for kind in ("plain", "kept"))

                def run_plain():
                    for run in train_group(cfgs, plain, progress=False):
                        load_or_probe(run, "final", args.device)

                def run_replay():
                    attribute_group(plain, spec, device=args.device, progress=False)

                def run_kept():
                    for run in train_group(cfgs, kept, progress=False, accounts=[account] * R):
                        load_or_probe(run, "final", args.device)
                    attribute_group(kept, spec, device=args.device, progress=False)

                order = ["plain+replay", "kept"][i % 2:] + ["plain+replay", "kept"][:i % 2]
                for kind in order:
                    if kind == "kept":
                        times["kept"].append(timed(run_kept))
                    else:
                        times["plain"].append(timed(run_plain))
                        times["replay"].append(timed(run_replay))
                a, b = totals([d / "attribution" for d in plain]), totals([d / "attribution" for d in kept])
                worst = max(worst, ((b - a).abs().max() / a.abs().max()).item())
            rows.append((R, {k: [statistics.median(t[j] for t in times[k]) for j in (0, 1)] for k in VARIANTS}))
    print(f"\noutputs: the attributions read from the accounts equal the replays' within {worst:.1e} of the largest "
          "|value| (every R, every round; summary totals)\n")
    head = "  ".join(f"{k + ' ' + u:>14}" for u in ("CPU s", "wall s") for k in VARIANTS)
    print(f"{'R':>3}  {head}  {'kept / (plain + replay) CPU':>28}  {'kept / plain CPU':>17}  "
          f"{'kept / (plain + replay) wall':>29}")
    for R, t in rows:
        cells = "  ".join(f"{t[k][j]:>14.1f}" for j in (0, 1) for k in VARIANTS)
        both = [t["plain"][j] + t["replay"][j] for j in (0, 1)]
        print(f"{R:>3}  {cells}  {t['kept'][0] / both[0]:>27.2f}x  {t['kept'][0] / t['plain'][0]:>16.2f}x  "
              f"{t['kept'][1] / both[1]:>28.2f}x")
    print(f"\nload average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, "
          f"at end {tuple(round(x, 2) for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
