"""Can ``torch.func.vmap`` run ``InfluenceTracker.track`` over a run axis? A tiny config (d_model 16, 2 runs stacked
by ``torch.func.stack_module_state``): track one step of run 0 alone through ``functional_call`` (works), then the
same function under vmap over the 2 runs' parameters; prints the first error and where it is raised
(docs/run-groups.md, "A run dimension inside the tracker").

    python benchmarks/try_vmap_tracker.py
"""

import copy
import traceback
import warnings

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from ntpflow.config import TrainConfig
from ntpflow.influence import InfluenceTracker, Probe
from ntpflow.model import GPT
from ntpflow.sites import Site
from ntpflow.training import make_optimizer, model_config, task_for

warnings.filterwarnings("ignore", message="There is a performance drop")
cfg = TrainConfig(task="majority", d_model=16, n_head=2, batch_size=8)
mcfg = model_config(cfg, task_for(cfg))
params, buffers = stack_module_state([GPT(mcfg, seed=s) for s in (0, 1)])  # each [2, ...]
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, mcfg.vocab_size, (2, 8, mcfg.n_ctx), generator=gen)  # [R, batch, pos]
mask = torch.ones_like(tokens, dtype=torch.bool)
probes = [Probe(Site(1, 5), "w", torch.randn(mcfg.d_model, generator=gen))]
final = GPT(mcfg, seed=9)  # stands in for θ*: built outside vmap (its random init cannot run inside)


class Tracked(nn.Module):
    """``forward(tokens, mask)`` -> the values of one step's influence rows [n_rows] of ``self.model``."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model
        self.opt = make_optimizer(model, cfg)  # on the template's leaf parameters: track reads lr, betas, state

    def forward(self, tokens, mask):
        rows = InfluenceTracker(final, probes).track(self.model, self.opt, tokens, mask)
        return torch.tensor([r["value"] for r in rows])


template = Tracked(copy.deepcopy(GPT(mcfg, seed=0)))


def one(p, b, t, m):
    return functional_call(template, ({f"model.{k}": v for k, v in p.items()}, {f"model.{k}": v for k, v in b.items()}),
                           (t, m))


alone = one({k: v[0] for k, v in params.items()}, {k: v[0] for k, v in buffers.items()}, tokens[0], mask[0])
print(f"run 0 through functional_call, no vmap: {alone.numel()} influence values")
try:
    print("vmap over the run axis works:", tuple(vmap(one)(params, buffers, tokens, mask).shape))
except Exception as e:  # noqa: BLE001 - the point is to show the first thing that breaks
    print(f"vmap over the run axis fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    for frame in traceback.extract_tb(e.__traceback__)[-3:]:
        print(f"  {frame.filename.split('site-packages/')[-1].split('ntpflow/')[-1]}:{frame.lineno}  {frame.line}")
