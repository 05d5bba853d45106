"""Which parts of the influence engine run under ``torch.func.vmap`` over a run axis? (docs/run-groups.md, "A run
dimension inside the tracker"; ``try_vmap_tracker.py`` shows that ``InfluenceTracker.track`` as a whole does not).

A tiny config (d_model 16, batch 8, float64), R = 3 runs of the majority task stacked by
``torch.func.stack_module_state``, each with its own tokens, directions and cotangents. Each part is run once under
vmap over the run axis (the template model's parameters swapped for the run's by ``_reparametrize_module``, the
mechanism of ``torch.func.functional_call``) and once per run on the run's own model; printed: the largest
difference.

- the cached ordinary forward ``forward_mode.Primals``;
- the forward mode: ``site_tangents`` (one site, 3 directions) and ``all_tangents``;
- the reverse mode: ``reverse_mode.site_vjps`` (2 cotangent rows) and ``own_cotangents``;
- the ordinary backward, functionally: ``torch.func.vjp`` of the loss with respect to the parameters and to zero
  perturbations added to r^k by a hook (what ``attribution._cotangent_pass`` gets from ``torch.autograd.grad``,
  which vmap cannot see through), and ∂L/∂logits by ``torch.func.grad``.

    python benchmarks/try_vmap_engine.py
"""

import copy
import warnings

import torch
from torch.func import stack_module_state, vmap
from torch.nn.utils.stateless import _reparametrize_module

from ntpflow.attribution import _cotangent_pass
from ntpflow.config import TrainConfig
from ntpflow.forward_mode import Primals, all_tangents, site_tangents
from ntpflow.loss import lm_loss
from ntpflow.model import GPT
from ntpflow.reverse_mode import own_cotangents, site_vjps
from ntpflow.sites import Site
from ntpflow.training import model_config, task_for

warnings.filterwarnings("ignore", message="There is a performance drop")  # vmap's fallback for CPU attention
LAYER, POS, R, BATCH = 1, 5, 3, 8
cfg = TrainConfig(task="majority", d_model=16, n_head=2, batch_size=BATCH)
mcfg = model_config(cfg, task_for(cfg))
models = [GPT(mcfg, seed=s).double() for s in range(R)]
params, buffers = stack_module_state(models)  # each [R, ...]
template = copy.deepcopy(models[0])
n_params = sum(p.numel() for p in template.parameters())
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, mcfg.vocab_size, (R, BATCH, mcfg.n_ctx), generator=gen)
mask = torch.ones_like(tokens, dtype=torch.bool)
dirs = torch.randn(R, 3, n_params, generator=gen, dtype=torch.float64)
cots = torch.randn(R, 2, BATCH, mcfg.d_model, generator=gen, dtype=torch.float64)
d_logits = torch.randn(R, 1, BATCH, mcfg.vocab_size, generator=gen, dtype=torch.float64)


def engine(model, tok, d, c, dl):
    """The pure parts on one run: (resid^k, site tangents, all tangents at layer k, site VJPs, own cotangents)."""
    pr = Primals(model, tok[:, :POS + 1])
    return (pr.resid[LAYER], site_tangents(pr, LAYER, POS, d), all_tangents(pr, LAYER, POS + 1, d)[LAYER],
            site_vjps(pr, LAYER, torch.tensor([POS, POS]), c, model.myopic),
            own_cotangents(pr, LAYER, torch.tensor([POS]), dl))


def backward(model, p, b, tok, msk):
    """The ordinary backward by torch.func: (full gradient [n_params], ∂L/∂r^LAYER [batch, pos, d], ∂L/∂logits)."""
    names = list(p)

    def loss_of(values, eps):
        with _reparametrize_module(model, {**dict(zip(names, values)), **b}):
            hook = model.blocks[LAYER - 1].hook_resid_post.add_hook(lambda a, _h: a + eps)  # r^LAYER + 0
            try:
                logits = model(tok)
            finally:
                hook.remove()
        return lm_loss(logits, tok, msk), logits

    eps = torch.zeros(*tok.shape, mcfg.d_model, dtype=torch.float64)
    loss, pull, logits = torch.func.vjp(loss_of, tuple(p.values()), eps, has_aux=True)
    g_params, g_eps = pull(torch.ones_like(loss))
    return (torch.cat([g.flatten() for g in g_params]), g_eps,
            torch.func.grad(lambda lg: lm_loss(lg, tok, msk))(logits))


def on_run(p, b, *args):
    with _reparametrize_module(template, {**p, **b}):
        return engine(template, *args)


batched = vmap(on_run)(params, buffers, tokens, dirs, cots, d_logits)
alone = [engine(m, tokens[r], dirs[r], cots[r], d_logits[r]) for r, m in enumerate(models)]
for j, name in enumerate(("Primals (resid^1)", "site_tangents", "all_tangents", "site_vjps", "own_cotangents")):
    err = max((batched[j][r] - alone[r][j]).abs().max().item() for r in range(R))
    print(f"{name:>18} under vmap over R={R} runs: max |vmapped - per run| = {err:.1e}")

full_v, c_all_v, _ = vmap(lambda p, b, t, m: backward(template, p, b, t, m))(params, buffers, tokens, mask)
for r, m in enumerate(models):
    full, c_all, *_ = _cotangent_pass(m, tokens[r], mask[r], [Site(LAYER, POS)], Primals(m, tokens[r][:, :POS + 1]))
    print(f"  ordinary backward by torch.func under vmap, run {r}: max |Δ full gradient| "
          f"{(full_v[r] - full).abs().max().item():.1e}, max |Δ ∂L/∂r^{LAYER}| "
          f"{(c_all_v[r] - c_all[LAYER]).abs().max().item():.1e} (vs torch.autograd.grad on the run's own model)")
