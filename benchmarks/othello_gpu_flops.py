"""FLOP count of the paper's Othello on a GPU (issue 32, scripts/othello_gpu.sh): the matmul FLOPs of a plain training
step and of a tracked replay step (Adam rows, the exact account on a readout set, per-type risks) of the paper's model
(6 layers, d 256, 4 heads, T 61), counted by torch's dispatch FLOP formulas (``bench_attribution.MatmulFlops``) at a
small batch and readout and scaled linearly to batch 1024 and the readout size (both costs are linear in them:
measured at two batch sizes to separate the batch and readout parts).

Usage: OMP_NUM_THREADS=1 python benchmarks/othello_gpu_flops.py [--scales paper-gpu,medium] [--batch 1024]
       [--readout 256] [--steps 5000]
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse

import numpy as np
import torch
from bench_attribution import MatmulFlops  # benchmarks/ is sys.path[0] when run as a script

from ntpflow.engine.influence import InfluenceTracker, Probe
from ntpflow.experiments.othello import SCALES
from ntpflow.model.gpt import GPT
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.run import model_config
from ntpflow.runs.training import make_optimizer, train_step
from ntpflow.tasks.othello import Othello


def count(scale: str, batch: int, readout: int) -> tuple[int, int]:
    """(plain step FLOPs, tracked step FLOPs) of the model and sites of ``scale`` at ``batch`` and ``readout``, the
    scale's squares, typed readout."""
    task = Othello(board_size=SCALES[scale].train.get("board_size", 8))
    sites = SCALES[scale].sites
    cfg = TrainConfig(task="othello", **{k: v for k, v in SCALES[scale].train.items() if k in (
        "n_layer", "d_model", "n_head", "lr", "board_size")}, device="cpu")
    mcfg = model_config(cfg, task)
    games = task.sample(batch + readout, np.random.default_rng(0))
    tok, mask = torch.as_tensor(games.tokens[:batch]), torch.as_tensor(games.loss_mask[:batch])
    held = torch.as_tensor(games.tokens[batch:])
    squares = SCALES[scale].squares
    idx = [task.feature_names.index(s) for s in squares]
    g = torch.Generator().manual_seed(0)
    probes = [Probe(s, n, torch.randn(cfg.d_model, generator=g)) for s in sites for n in squares]
    types = {n: torch.as_tensor(games.feature_types[batch:, :, i]).long() for n, i in zip(squares, idx)}
    model, final = GPT(mcfg, seed=0), GPT(mcfg, seed=1)
    opt = make_optimizer(model, cfg)
    train_step(model, opt, tok, mask)
    with MatmulFlops() as fc:
        train_step(model, opt, tok, mask)
    plain = fc.flops
    tracker = InfluenceTracker(final, probes, sgd_rows=False)
    tracker.use_readout(held, types)
    tracker.track(model, opt, tok, mask)
    tracker.optimizer_step(model, opt)
    with MatmulFlops() as fc:
        tracker.track(model, opt, tok, mask)
        tracker.optimizer_step(model, opt)
    return plain, fc.flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readout", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--scales", default="paper-gpu", help="comma-separated Othello scales (their model and sites)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name in a.scales.split(","):
        sites = SCALES[name].sites
        p1, t1 = count(name, 8, 8)
        p2, t2 = count(name, 16, 8)
        per_row_plain, per_row_track = (p2 - p1) / 8, (t2 - t1) / 8
        per_readout = (t1 - per_row_track * 8) / 8
        plain = per_row_plain * a.batch
        tracked = per_row_track * a.batch + per_readout * a.readout
        print(f"{name}: {len(sites)} sites x 16 squares; plain step {plain / 1e9:.1f} GFLOP at batch {a.batch}; "
              f"tracked step {tracked / 1e9:.1f} GFLOP with a readout of {a.readout} "
              f"(= {tracked / plain:.2f} plain steps: batch part {per_row_track * a.batch / plain:.2f}, readout part "
              f"{per_readout * a.readout / plain:.2f}); {a.steps} steps: training {plain * a.steps:.2e}, "
              f"replay {tracked * a.steps:.2e} FLOPs")


if __name__ == "__main__":
    main()
