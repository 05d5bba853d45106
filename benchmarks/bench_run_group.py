"""Run groups vs separate runs: one training step of R runs as one batched model (``ntpflow.runs.group``) against
R ordinary steps one after another, at the paper's toy size (2 layers, d_model 128, 4 heads, T 21, vocab 5, batch
256, fused Adam lr 1e-3).

Both variants are timed side by side in one run: every round times each R's group step and its R separate steps,
the order rotating each round; medians over rounds. On CUDA the clock is read after ``torch.cuda.synchronize()``.

Targets (issue 16): on the CPU, R = 10 batched takes no more than 1.1x the time of 10 separate steps; on a GPU, the
throughput at R = 80 is at least 20x that of runs one after another.

    python benchmarks/bench_run_group.py                      # CPU: R = 1, 4, 10, 40
    python benchmarks/bench_run_group.py --device cuda        # GPU: R = 1, 10, 40, 80
"""

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from ntpflow.files import resolve_device
from ntpflow.model.gpt import GPT
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.group import group_step, stack_runs
from ntpflow.runs.run import model_config, task_for
from ntpflow.runs.training import make_optimizer, train_step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, ...")
    p.add_argument("--runs", help="comma-separated R values (default 1,4,10,40 on the CPU, 1,10,40,80 on a GPU)")
    p.add_argument("--regime", default="vanilla", help="regime of the runs (default vanilla)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    return args


class Bench:
    """R runs at the toy size: their separate models and Adams, the same runs stacked, and one batch per run."""

    def __init__(self, R: int, regime: str, device: torch.device):
        self.cfg = TrainConfig(task="majority", regime=regime)
        mcfg = model_config(self.cfg, task_for(self.cfg))
        self.models = [GPT(mcfg, seed=s).to(device) for s in range(R)]
        self.opts = [make_optimizer(m, self.cfg) for m in self.models]
        self.stack, self.group_opt = stack_runs(self.models, self.opts, self.cfg)
        gen = torch.Generator().manual_seed(R)
        self.tokens = torch.randint(0, mcfg.vocab_size, (R, self.cfg.batch_size, mcfg.n_ctx), generator=gen).to(device)
        self.mask = torch.ones_like(self.tokens, dtype=torch.bool)

    def separate(self):
        return [train_step(m, o, self.tokens[r], self.mask[r]).item()
                for r, (m, o) in enumerate(zip(self.models, self.opts))]

    def group(self):
        return group_step(self.stack, self.group_opt, self.tokens, self.mask).tolist()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    Rs = [int(x) for x in (args.runs or ("1,10,40,80" if device.type == "cuda" else "1,4,10,40")).split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}"
    print(f"run-group benchmark  {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, device {device} ({name}), "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"toy size: n_layer 2, d_model 128, n_head 4, T 21, vocab 5, batch 256 per run, regime {args.regime}, "
          f"fused Adam; R = {Rs}; warm-up {args.warmup}, rounds {args.rounds}")
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    benches = {R: Bench(R, args.regime, device) for R in Rs}
    worst = 0.0
    for R, b in benches.items():  # start-up check: both variants give each run the same first loss
        sep, grp = b.separate(), b.group()
        worst = max(worst, max(abs(x - y) / abs(x) for x, y in zip(sep, grp)))
        for _ in range(args.warmup):
            b.separate(), b.group()
    print(f"start-up check: first-step losses, group vs separate, max relative difference {worst:.1e}")
    sync()
    variants = [(R, kind) for R in Rs for kind in ("separate", "group")]
    times = {v: [] for v in variants}
    for i in range(args.rounds):
        k = i % len(variants)
        for R, kind in variants[k:] + variants[:k]:
            fn = getattr(benches[R], kind)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[(R, kind)].append(time.perf_counter() - t0)
    med = {v: statistics.median(t) for v, t in times.items()}
    print()
    print(f"{'R':>4} {'separate ms':>12} {'group ms':>10} {'group/separate':>15} {'run-steps/s separate':>21} "
          f"{'run-steps/s group':>18} {'speed-up':>9}")
    for R in Rs:
        s, g = med[(R, "separate")], med[(R, "group")]
        print(f"{R:>4} {s * 1e3:>12.1f} {g * 1e3:>10.1f} {g / s:>15.2f} {R / s:>21.1f} {R / g:>18.1f} {s / g:>8.2f}x")
    print()
    fails = 0
    if device.type == "cpu" and 10 in Rs:
        ratio = med[(10, "group")] / med[(10, "separate")]
        fails += ratio > 1.1
        print(f"target (CPU): R = 10 group / separate = {ratio:.2f} <= 1.1: {'PASS' if ratio <= 1.1 else 'FAIL'}")
    if device.type == "cuda" and 80 in Rs:
        gain = med[(80, "separate")] / med[(80, "group")]
        fails += gain < 20
        print(f"target (GPU): R = 80 throughput / one after another = {gain:.1f}x >= 20: "
              f"{'PASS' if gain >= 20 else 'FAIL'}")
    if load0 is not None:
        print(f"load average (1, 5, 15 min) at start {tuple(round(x, 2) for x in load0)}, "
              f"at end {tuple(round(x, 2) for x in os.getloadavg())}")
    print("RESULT: all targets PASS" if not fails else f"RESULT: {fails} target(s) FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
