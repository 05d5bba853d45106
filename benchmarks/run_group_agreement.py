"""How closely a run trained in a run group agrees with the same run trained alone (docs/run-groups.md).

For each regime, trains seeds 0 and 1 as one group and each seed alone, at the toy architecture (d_model 128,
batch 256; 25,600 training sequences), and prints per run: how many weight tensors are bit-identical, the largest
|Δθ| between the two final weights, the largest weight change of the run itself, and both final eval losses.

    python benchmarks/run_group_agreement.py --steps 20 --out /tmp/run-group-agreement
"""

import argparse
import shutil
import sys
from pathlib import Path

import torch

from ntpflow.files import load_tensors
from ntpflow.runs.config import REGIMES, TrainConfig
from ntpflow.runs.group import train_group
from ntpflow.runs.training import train


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--out", default="/tmp/run-group-agreement", help="scratch folder (emptied first)")
    args = p.parse_args(argv)
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    s = args.steps
    settings = dict(task="majority", steps=s, n_train=25_600, n_eval=512, eval_every=s, ckpt_every=s, log_every=s)
    print(f"torch {torch.__version__}, {args.steps} steps, toy architecture, seeds 0 and 1")
    for regime in REGIMES:
        cfgs = [TrainConfig(regime=regime, seed=seed, **settings) for seed in (0, 1)]
        grouped = train_group(cfgs, [root / f"{regime}-group-s{c.seed}" for c in cfgs], progress=False)
        for g, cfg in zip(grouped, cfgs):
            a = train(cfg, root / f"{regime}-alone-s{cfg.seed}", progress=False)
            G, A, A0 = (load_tensors(r.weights_path(w)) for r, w in ((g, "final"), (a, "final"), (a, "init")))
            keys = [k for k in A if k.startswith("model.")]
            same = sum(torch.equal(G[k], A[k]) for k in keys)
            gap = max((G[k] - A[k]).abs().max().item() for k in keys)
            moved = max((A[k] - A0[k]).abs().max().item() for k in keys)
            print(f"{regime:<14} seed {cfg.seed}: bit-identical tensors {same}/{len(keys)}, max |Δθ| {gap:.2e} "
                  f"(max |θ_T − θ_0| {moved:.2e}), final eval loss group {g.metrics()[-1]['eval_loss']:.6f} "
                  f"alone {a.metrics()[-1]['eval_loss']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
