"""What the momentum-SGD control of toy claim (c) on conditioned majority costs: its training step with and without
the exact account, side by side in one process, and what the five tracked seeds of 20,000 steps then need.

Each configuration trains twice into fresh folders (``--short`` and ``--long`` steps, both with a warmup of ``--long``
steps to the scale's peak rate, so the short run is the long one's first steps and the difference is the cost of
steps ``short``..``long`` − 1, without start-up, data generation and the final evaluation), the order rotating between
rounds; medians of the per-step CPU seconds (one torch thread) over ``--rounds``. Configurations: the scale ``medium-momentum-cond``'s model (2 layers, d_model
128, batch 256, SGD with momentum on its warmup-cosine schedule) plain, and with the account at its four sites
(readout 256); and the same account on a d_model-16 model, whose step is almost free of FLOPs, so its time is the
per-step overhead of the account's many small operations (Python and operator dispatch): what a GPU, which removes
the FLOPs but not the launches, would still pay per step and per run. Also printed: the single-thread matmul rate at
the model's shapes, and a floor from counted FLOPs: the training step's matmuls plus the account's quadrature on the
readout (two Gauss–Legendre nodes, each a forward of the block below the sites and the forward-mode tangents along the
step's 18 directions: two shared by every site over all positions, four per site through its query alone; then the
step's end), without the components' gradients, at that matmul rate.

    python benchmarks/bench_control_cost.py                 # steps 10 and 30, 2 rounds
    python benchmarks/bench_control_cost.py --long 50        # the committed figures (BENCHMARKS.md)
"""

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from ntpflow.experiments.toy import SCALES, run_configs
from ntpflow.model.sites import parse_sites
from ntpflow.runs.account import AccountSpec
from ntpflow.runs.run import task_for
from ntpflow.runs.training import train

SITES = "1:4,1:6,1:8,1:14"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", type=int, default=10, help="steps of the short run (default 10)")
    p.add_argument("--long", type=int, default=30, help="steps of the long run (default 30)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--root", help="folder for the runs (default: a temporary one)")
    return p.parse_args(argv)


def matmul_rate(m: int, k: int, n: int, repeats: int = 20) -> float:
    """GFLOP/s of [m, k] @ [k, n] in float32 on this thread."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9


def account_flops(d: int, readout: int, positions: list[int], nodes: int = 2) -> float:
    """Matmul FLOPs of one step's quadrature at layer-1 sites ``positions`` (block 0 below them) on ``readout``
    sequences: per node the cached forward over positions ≤ the last site, the tangents along the two shared
    directions there (a tangent's matmuls are twice the forward's: ẋW + xẆ), and along four own directions per site
    (the keys and values over its prefix, the rest at its query alone); then the step's end (one forward)."""
    n_pos = max(positions) + 1
    forward = 2 * 12 * d * d * readout * n_pos
    shared = 2 * 2 * forward
    own = sum(4 * 2 * 2 * readout * (3 * d * d * (p + 1) + 9 * d * d) for p in positions)
    return nodes * (forward + shared + own) + forward


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    base = run_configs(SCALES["medium-momentum-cond"], ("cond_majority",), ("vanilla",))[0]
    account = AccountSpec(tuple(parse_sites(SITES)), 256, chunks=1)
    configs = {"plain d128": (base, None), "account d128": (base, account),
               "account d16": (replace(base, d_model=16, n_head=2), account)}
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-control-"))
    per_step: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):
        names = list(configs)[r % len(configs):] + list(configs)[:r % len(configs)]
        for name in names:
            cfg, spec = configs[name]
            cpu = {}
            for steps in (args.short, args.long):
                c = replace(cfg, steps=steps, n_train=cfg.batch_size * args.long, n_eval=1024, eval_every=steps,
                                ckpt_every=steps, log_every=steps, warmup=args.long, device="cpu")
                start = time.process_time()
                train(c, root / f"r{r}-{name.replace(' ', '-')}-{steps}", progress=False, account=spec)
                cpu[steps] = time.process_time() - start
            per_step[name].append((cpu[args.long] - cpu[args.short]) / (args.long - args.short))
    med = {k: statistics.median(v) for k, v in per_step.items()}
    tokens, d, layers = base.batch_size * task_for(base).seq_len, base.d_model, base.n_layer
    flops = 3 * 2 * layers * 12 * d * d * tokens  # forward + backward of the blocks' matmuls
    rate = matmul_rate(tokens, d, 4 * d)
    floor = flops + account_flops(d, 256, [s.pos for s in parse_sites(SITES)])
    steps, seeds = base.steps, len(SCALES["medium-momentum-cond"].seeds)
    print(f"one torch thread; {args.rounds} rounds of {args.short} and {args.long} steps; CPU s per step (medians)")
    for name, s in med.items():
        print(f"  {name}: {s:.3f} s a step; {seeds} seeds × {steps} steps = {s * steps * seeds / 3600:.1f} core-hours")
    print(f"  the account's own cost: {med['account d128'] / med['plain d128']:.2f}× the plain step")
    print(f"  plain step: {flops / 1e9:.1f} GFLOP of matmuls at {flops / med['plain d128'] / 1e9:.0f} GFLOP/s; "
          f"matmul [{tokens}, {d}] @ [{d}, {4 * d}] alone: {rate:.0f} GFLOP/s")
    print(f"  floor with the account: {floor / 1e9:.1f} GFLOP a step (training + quadrature, without the components' "
          f"gradients): {floor / rate / 1e9:.2f} s at that rate, {floor * steps * seeds / rate / 1e9 / 3600:.1f} "
          f"core-hours for the {seeds} seeds; measured {med['account d128'] * rate * 1e9 / floor:.2f}× the floor")


if __name__ == "__main__":
    main()
