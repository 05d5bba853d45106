"""Training with the account on one process against N workers (``ntpflow train --account ... --workers N``), side
by side, each a whole command (``python -m ntpflow``: start-up included), the order alternating between rounds.

One process runs on ``--threads`` torch threads (default: the cores); the workers split the cores (cores // N
threads each). Printed: median wall seconds of each and their ratio (the speed-up). The paper's toy model (majority,
2 layers, d_model 128), batch 64, the toy medium scale's four sites, readout 256.

    python benchmarks/bench_account_workers.py                  # 40 steps, 2 workers, 2 rounds
    python benchmarks/bench_account_workers.py --steps 100 --rounds 3
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="one process's torch threads (default: cores)")
    p.add_argument("--sites", default="1:4,1:6,1:8,1:14", help="account sites (default: the toy medium scale's)")
    p.add_argument("--readout", type=int, default=256, help="readout sequences (default 256)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    return p.parse_args(argv)


def run(out: Path, args, workers: int) -> float:
    cmd = [sys.executable, "-m", "ntpflow", "-q", "train", "--task", "majority", "--device", "cpu", "--out", str(out),
           "--account", args.sites, "--readout", str(args.readout), "--set", "n_layer=2", "d_model=128", "n_head=4",
           "batch_size=64", f"steps={args.steps}", f"n_train={64 * args.steps}", "n_eval=1024",
           f"eval_every={args.steps}", f"ckpt_every={args.steps}", f"log_every={args.steps}"]
    env = dict(os.environ)
    if workers > 1:
        cmd += ["--workers", str(workers)]
        env["OMP_NUM_THREADS"] = str(max(1, args.threads // workers))
    else:
        env["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv=None) -> None:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    times: dict[str, list[float]] = {"one": [], "workers": []}
    for r in range(args.rounds):
        for name in (["one", "workers"] if r % 2 == 0 else ["workers", "one"]):
            times[name].append(run(root / f"{name}-{r}", args, args.workers if name == "workers" else 1))
    one, many = statistics.median(times["one"]), statistics.median(times["workers"])
    print(f"majority, 2 layers, d_model 128, batch 64, {args.steps} steps, sites {args.sites}, readout "
          f"{args.readout}; {args.rounds} rounds, median wall s: one process ({args.threads} threads) {one:.1f}, "
          f"{args.workers} workers ({max(1, args.threads // args.workers)} thread(s) each) {many:.1f}; speed-up "
          f"{one / many:.2f}×")


if __name__ == "__main__":
    main()
