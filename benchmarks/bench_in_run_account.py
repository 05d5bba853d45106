"""The exact account kept while training (``train --account``) against plain training plus a replay
(``attribute``, the exact account's replay), side by side in one process, the order rotating between rounds.

Each round times, into fresh folders: plain training; the replay of that run (``attribute``, its probes fitted
first); training with the account, followed by the ``attribute`` that reads it (no replay; its probes fitted first). Printed per configuration (sites × readout): medians of the process's CPU
time (one torch thread; steadier than wall time on a shared machine) and of wall time, and the ratios
in-run / (plain + replay) (the pass saved) and in-run / plain (the account's own cost). The account keeps chunks of 10
steps (a run of 1000+ steps keeps at most 100 chunks, so 10 or more steps each). The paper's toy model
(majority, 2 layers, d_model 128), batch ``--batch``; readout = batch and 4 × batch by default. Memory per site: the
account's accumulators per chunk, from its chunk files.

    python benchmarks/bench_in_run_account.py                          # 40 steps, batch 64, sites 1:4 and 4 sites
    python benchmarks/bench_in_run_account.py --steps 100 --rounds 3
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ntpflow.model.sites import parse_sites
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import AccountSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.run import Run
from ntpflow.runs.training import train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--readouts", default="1,4", help="readout sizes as multiples of the batch (default 1,4)")
    p.add_argument("--sites", default="1:4;1:4,1:6,1:8,1:14", help="site lists, ';'-separated (default: one site, "
                   "and the toy medium scale's four)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--root", help="folder for the runs (default: a temporary one)")
    return p.parse_args(argv)


def timed(fn) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of ``fn()``."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(task="majority", n_layer=2, d_model=128, n_head=4, batch_size=args.batch, steps=args.steps,
                      n_train=args.batch * args.steps, n_eval=max(1024, 4 * args.batch), eval_every=args.steps,
                      ckpt_every=args.steps, log_every=args.steps, device="cpu")
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-in-run-"))
    chunks = max(1, args.steps // 10)  # 10 steps a chunk (a real run's default: at most 100 chunks over its steps)
    configs = [(sites, k * args.batch) for sites in args.sites.split(";") for k in map(int, args.readouts.split(","))]
    print(f"model: majority, 2 layers, d_model 128, batch {args.batch}, {args.steps} steps, Adam; {args.threads} "
          f"torch thread(s); {args.rounds} rounds; medians of CPU s (wall s)")
    results: dict[tuple, dict[str, list]] = {c: {"plain": [], "replay": [], "in-run": []} for c in configs}
    memory: dict[tuple, float] = {}
    for r in range(args.rounds):
        for j, (sites, readout) in enumerate(configs):
            parsed = parse_sites(sites)
            base = root / f"r{r}-{j}"
            plain, accounted = base / "plain", base / "accounted"
            jobs = {
                "plain": lambda: train(cfg, plain, progress=False),
                "replay": lambda: attribute(plain, AttributionSpec(parsed, ["is_majority_<0>"], readout=readout),
                                            progress=False),
                "in-run": lambda: (train(cfg, accounted, progress=False, account=AccountSpec(tuple(parsed), readout,
                                                                              chunks=chunks)),
                                   attribute(accounted, AttributionSpec(parsed, ["is_majority_<0>"]), progress=False)),
            }
            order = ["plain", "replay", "in-run"] if r % 2 == 0 else ["in-run", "plain", "replay"]
            for name in order:
                results[(sites, readout)][name].append(timed(jobs[name]))
            chunk = Run.open(accounted).account.chunk_files()[0]
            memory[(sites, readout)] = chunk.stat().st_size / len(parsed) / 2**20
    for (sites, readout), res in results.items():
        med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in res.items()}
        saved = [med["in-run"][i] / (med["plain"][i] + med["replay"][i]) for i in (0, 1)]
        own = [med["in-run"][i] / med["plain"][i] for i in (0, 1)]
        print(f"sites {sites}, readout {readout} ({readout // args.batch} × batch): plain {med['plain'][0]:.1f} "
              f"({med['plain'][1]:.1f}), replay {med['replay'][0]:.1f} ({med['replay'][1]:.1f}), in-run "
              f"{med['in-run'][0]:.1f} ({med['in-run'][1]:.1f}); in-run / (plain + replay) {saved[0]:.2f} "
              f"({saved[1]:.2f}); in-run / plain {own[0]:.2f} ({own[1]:.2f}); a chunk's file "
              f"{memory[(sites, readout)]:.2f} MiB per site")


if __name__ == "__main__":
    main()
