"""Othello game generation benchmark (issue 5): ntpflow's bitboard engine vs a plain per-game engine.

Games per second on ONE core (the process pins itself to one CPU unless ``--no-pin``; BLAS/OpenMP threads
are set to 1; torch is not used). Variants, timed side by side in one run, interleaved round-robin with the
order rotating each round, medians over rounds:

    fast_moves    othello_engine.random_moves(n)         moves only
    fast_full     othello_engine.random_games(n)         moves + boards + legal masks + square types
    task_sample   Othello().sample(n)                    fast_full plus the Batch (tokens, legal [n,61,67], float32 features)
    task_tokens   Othello().sample_tokens(n)             the token-only Batch of a training set (issue 32)
    base_moves    othello_baseline.play_games(n, states=False)  plain per-game Python, moves only
    base_full     othello_baseline.play_games(n)          plain per-game Python, boards + legal + types

Before timing, a few baseline games are replayed by the fast engine (``play_moves``) and their boards, legal
masks and square types compared (same rules, independent code).

Targets (issue 5): fast_full >= 2,000 games/s, fast_moves >= 20,000 games/s.

Usage:
    python benchmarks/bench_othello.py [--rounds 5] [--fast-n 8192] [--full-n 4096] [--task-n 1024]
                                       [--base-n 20] [--base-full-n 2] [--no-pin]

Exits 0 whatever the PASS/FAIL outcome; it only reports.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np
import othello_baseline as base  # benchmarks/ is sys.path[0] when run as a script

from ntpflow.tasks.othello import Othello
from ntpflow.tasks.othello_engine import play_moves, random_games, random_moves

TARGETS = (("fast_full", 2_000), ("fast_moves", 20_000))


def check_agreement(n: int = 3, seed: int = 123) -> None:
    moves, boards, legal, types = base.play_games(n, seed)
    g = play_moves(moves)
    ok = (
        np.array_equal(g.boards, boards) and np.array_equal(g.legal, legal) and np.array_equal(g.types, types)
    )
    print(f"check: {n} baseline games replayed by the fast engine: {'identical' if ok else 'MISMATCH'}")
    if not ok:
        sys.exit("baseline and fast engine disagree")


def _bytes_per_game(task: Othello) -> float:
    """Bytes of one game in a full Batch (tokens, loss mask, legal, features, feature types)."""
    b = task.sample(64, np.random.default_rng(0))
    return sum(x.nbytes for x in (b.tokens, b.loss_mask, b.legal, b.features, b.feature_types)) / 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fast-n", type=int, default=8192, help="games per call, fast moves-only")
    ap.add_argument("--full-n", type=int, default=4096, help="games per call, fast with boards/legal/types")
    ap.add_argument("--task-n", type=int, default=1024, help="games per Othello().sample call")
    ap.add_argument("--base-n", type=int, default=20, help="games per call, baseline moves-only")
    ap.add_argument("--base-full-n", type=int, default=2, help="games per call, baseline with types")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    args = ap.parse_args()
    for name in ("rounds", "fast_n", "full_n", "task_n", "base_n", "base_full_n"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")

    print("command: python " + " ".join([sys.argv[0]] + sys.argv[1:]))
    pinned = "not pinned"
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        pinned = f"pinned to CPU {cpu}"
    print(
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}  python {platform.python_version()}  numpy {np.__version__}"
        f"  {pinned}  ({os.cpu_count()} CPUs)"
    )
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    check_agreement()

    task = Othello()
    seeds = iter(range(10**6))
    variants = {
        "fast_moves": (args.fast_n, lambda n: random_moves(n, next(seeds))),
        "fast_full": (args.full_n, lambda n: random_games(n, next(seeds))),
        "task_sample": (args.task_n, lambda n: task.sample(n, np.random.default_rng(next(seeds)))),
        "task_tokens": (args.fast_n, lambda n: task.sample_tokens(n, np.random.default_rng(next(seeds)))),
        "base_moves": (args.base_n, lambda n: base.play_games(n, next(seeds), with_states=False)),
        "base_full": (args.base_full_n, lambda n: base.play_games(n, next(seeds))),
    }
    for n, fn in variants.values():  # warm-up
        fn(min(n, 64))
    rates: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            n, fn = variants[name]
            t0 = time.perf_counter()
            fn(n)
            rates[name].append(n / (time.perf_counter() - t0))

    print(f"\n{'variant':<12} {'games/call':>10} {'median games/s':>15} {'min':>11} {'max':>11}")
    med = {}
    for name in names:
        med[name] = statistics.median(rates[name])
        print(
            f"{name:<12} {variants[name][0]:>10,} {med[name]:>15,.1f} {min(rates[name]):>11,.1f}"
            f" {max(rates[name]):>11,.1f}"
        )
    print("\nratios (median games/s):")
    print(f"  fast_moves / base_moves   {med['fast_moves'] / med['base_moves']:>10,.0f}x")
    print(f"  fast_full  / base_full    {med['fast_full'] / med['base_full']:>10,.0f}x")
    print(f"  task_sample / fast_full   {med['task_sample'] / med['fast_full']:>10,.2f}x  (info)")
    print(f"  task_tokens / task_sample {med['task_tokens'] / med['task_sample']:>10,.1f}x  (a training set's games, "
          f"549 B each against {_bytes_per_game(task):,.0f} B)")
    print("\ntargets (one core):")
    for name, bound in TARGETS:
        verdict = "PASS" if med[name] >= bound else "FAIL"
        print(f"  {name:<12} {med[name]:>10,.0f} games/s  target >= {bound:,}  {verdict}")
    if load0 is not None:
        print(f"\nload average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, "
              f"at end {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
