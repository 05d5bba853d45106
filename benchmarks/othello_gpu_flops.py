"""FLOP count of the paper's Othello on a GPU (issue 32, scripts/othello_gpu.sh): the matmul FLOPs of a plain training
step and of a tracked replay step (Adam rows, the exact account on a readout set, per-type risks) of the paper's model
(6 layers, d 256, 4 heads, T 61), counted by torch's dispatch FLOP formulas (``bench_attribution.MatmulFlops``) at a
small batch and readout and scaled linearly to batch 1024 and the readout size (both costs are linear in them:
measured at two batch sizes to separate the batch and readout parts). The step counted is an unrefined one (the
2-point Gauss–Legendre rule; with the default ladder, the random weights of the count make its step refine up to
31 times as many points, and the readout part was overstated accordingly until 2026-12-06); each point a refined
step adds is counted apart (by the 4-point rule), so a run's refined fraction (its summary's ``refined`` count)
prices its refinement.

Usage: OMP_NUM_THREADS=1 python benchmarks/othello_gpu_flops.py [--scales paper-gpu,medium] [--batch 1024]
       [--readout 256] [--steps 5000] [--sites K:I,...] [--time N]
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import time

import numpy as np
import torch
from bench_attribution import MatmulFlops  # benchmarks/ is sys.path[0] when run as a script

from ntpflow.engine.influence import InfluenceTracker, Probe
from ntpflow.experiments.othello import SCALES
from ntpflow.model.gpt import GPT
from ntpflow.model.sites import Site, parse_sites
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.run import model_config
from ntpflow.runs.training import make_optimizer, train_step
from ntpflow.tasks.othello import Othello


def setup(scale: str, batch: int, readout: int, points: int = 2, sites: tuple[Site, ...] | None = None):
    """(model, optimizer, tokens, loss mask, tracker) of ``scale``'s model after one plain step at ``batch``: the
    tracker on the scale's squares at ``sites`` (default the scale's) with random probes, a typed readout of
    ``readout`` games, every step integrated by the ``points``-point rule (no refinement)."""
    task = Othello(board_size=SCALES[scale].train.get("board_size", 8))
    sites = sites or SCALES[scale].sites
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
    tracker = InfluenceTracker(final, probes, sgd_rows=False)
    tracker.use_readout(held, types, levels=(points,), pieces=())
    return model, opt, tok, mask, tracker


def tracked_step(model, opt, tok, mask, tracker) -> None:
    tracker.track(model, opt, tok, mask)
    tracker.optimizer_step(model, opt)


def count(scale: str, batch: int, readout: int, points: int = 2, sites: tuple[Site, ...] | None = None
          ) -> tuple[int, int]:
    """(plain step FLOPs, tracked step FLOPs) of :func:`setup`'s model and tracker (after one tracked step)."""
    model, opt, tok, mask, tracker = setup(scale, batch, readout, points, sites)
    with MatmulFlops() as fc:
        train_step(model, opt, tok, mask)
    plain = fc.flops
    tracked_step(model, opt, tok, mask, tracker)
    with MatmulFlops() as fc:
        tracked_step(model, opt, tok, mask, tracker)
    return plain, fc.flops


def seconds(scale: str, batch: int, readout: int, sites: tuple[Site, ...] | None, reps: int) -> tuple[float, float]:
    """Median CPU seconds of a plain and of a tracked (unrefined) step of :func:`setup`, measured alternately
    ``reps`` times each, so that the machine's load falls on both alike."""
    model, opt, tok, mask, tracker = setup(scale, batch, readout, 2, sites)
    tracked_step(model, opt, tok, mask, tracker)  # warm
    plain, tracked = [], []
    for _ in range(reps):
        for run, out in ((lambda: train_step(model, opt, tok, mask), plain),
                         (lambda: tracked_step(model, opt, tok, mask, tracker), tracked)):
            c0 = time.process_time()
            run()
            out.append(time.process_time() - c0)
    return float(np.median(plain)), float(np.median(tracked))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readout", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--scales", default="paper-gpu", help="comma-separated Othello scales (their model and sites)")
    ap.add_argument("--time", type=int, default=0, metavar="N",
                    help="also time N plain and N tracked steps alternately at the full batch and readout")
    ap.add_argument("--sites", default="", help="sites instead of each scale's (e.g. 3:18 or 2-3:12,18)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    only = tuple(parse_sites(a.sites)) if a.sites else None
    for name in a.scales.split(","):
        sites = only or SCALES[name].sites
        p1, t1 = count(name, 8, 8, sites=sites)
        p2, t2 = count(name, 16, 8, sites=sites)
        t4 = count(name, 8, 8, points=4, sites=sites)[1]
        per_row_plain, per_row_track = (p2 - p1) / 8, (t2 - t1) / 8
        per_readout = (t1 - per_row_track * 8) / 8
        per_point = (t4 - t1) / 2 / 8  # one more quadrature point, per readout game
        plain = per_row_plain * a.batch
        tracked = per_row_track * a.batch + per_readout * a.readout
        print(f"{name}: {len(sites)} sites x {len(SCALES[name].squares)} squares; plain step {plain / 1e9:.1f} GFLOP at batch {a.batch}; "
              f"tracked step {tracked / 1e9:.1f} GFLOP with a readout of {a.readout}, unrefined "
              f"(= {tracked / plain:.2f} plain steps: batch part {per_row_track * a.batch / plain:.2f}, readout part "
              f"{per_readout * a.readout / plain:.2f}; each point a refined step adds: "
              f"{per_point * a.readout / plain:.2f}); {a.steps} steps: training {plain * a.steps:.2e}, "
              f"replay {tracked * a.steps:.2e} FLOPs unrefined")
        if a.time:
            sp, st = seconds(name, a.batch, a.readout, sites, a.time)
            print(f"{name}: measured at batch {a.batch}, readout {a.readout}, one thread, median of {a.time} "
                  f"alternated: plain step {sp:.2f} CPU-s, tracked step {st:.2f} CPU-s (= {st / sp:.2f} plain steps); "
                  f"{a.steps} steps: replay {st * a.steps / 3600:.1f} core-hours unrefined")


if __name__ == "__main__":
    main()
