"""Exact decomposition of the training gradient at residual sites (paper Prop. 3.1).

For a site ⟨k, i⟩ (layer/position convention of ``ntpflow.model.sites``; the loss at position i predicts token i+1):

    direct     = ∇L_i − ∇L_i^{sg(k,i)}
    pre_cached = Σ_{j≠i} ∇(L_j − L_j^{sg(k,i)})
    shared     = Σ_j ∇L_j^{sg(k,i)}
    full       = ∇L = direct + pre_cached + shared

with L = Σ_j L_j the training loss (``lm_loss``: mean over counted positions of per-position batch means).

How it is computed: ∇L − ∇L^{sg(k,i)} = (∂r^k_i/∂θ)ᵀ ∂L/∂r^k_i, a vector–Jacobian product of the site's residual.
The ordinary backward gives ∂L/∂r^k; the own-position cotangent ∂L_i/∂r^k_i comes from a short backward through
the blocks above k at query i alone (``reverse_mode.own_cotangents``; in a myopic model, or at the last layer, it
equals ∂L/∂r^k_i).
The VJPs themselves run by the hand-written reverse mode of ``ntpflow.engine.reverse_mode`` on one cached ordinary forward
(positions ≤ i, the site's own block for query i alone), in the model's own regime.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ntpflow.engine.forward_mode import Primals
from ntpflow.engine.reverse_mode import own_cotangents, site_vjps
from ntpflow.model.gpt import GPT
from ntpflow.model.hooks import HookPoint
from ntpflow.model.loss import lm_loss, lm_loss_part
from ntpflow.model.shapes import FlatParams, Mask, Tokens
from ntpflow.model.sites import Site


@dataclass
class Components:
    """The four gradients at one site, each a flat vector [n_params] in ``model.parameters()`` order."""

    direct: FlatParams
    pre_cached: FlatParams
    shared: FlatParams
    full: FlatParams

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The four components by name ("direct", "pre_cached", "shared", "full"), each [n_params]."""
        return {"direct": self.direct, "pre_cached": self.pre_cached, "shared": self.shared, "full": self.full}


def flat_grads(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], batch: int | None = None):
    """Concatenate per-parameter gradients (None = zero) into [n_params] (or [batch, n_params] if batched)."""
    parts = []
    for g, p in zip(grads, params):
        if g is None:
            g = p.new_zeros(((batch,) if batch is not None else ()) + p.shape)
        parts.append(g.reshape(batch, -1) if batch is not None else g.reshape(-1))
    return torch.cat(parts, dim=-1)


def _cotangent_pass(model: GPT, tokens: torch.Tensor, loss_mask: torch.Tensor | None, sites: Sequence[Site],
                    primals: Primals, functional: bool = False, weights: torch.Tensor | None = None):
    """(full gradient [n_params], c_all {k: ∂L/∂r^k}, c_own {k: ∂L_i/∂r^k_i, filled at the sites' positions},
    the per-parameter gradients, the loss (0-dim, detached)), cotangents [batch, pos, d_model]: one forward and backward in the model's own
    regime (``torch.autograd``, or ``torch.func`` with ``functional``, which runs under ``vmap``), plus
    ``reverse_mode.own_cotangents`` on ``primals`` (the cached ordinary forward) where a later loss can reach
    r^k_i. ``weights``: the rows are a part of a batch, whose loss is ``lm_loss_part`` with these position weights."""
    params = list(model.parameters())
    layers = sorted({s.layer for s in sites})
    backward = _functional_backward if functional else _autograd_backward

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return (lm_loss(logits, tokens, loss_mask) if weights is None
                else lm_loss_part(logits, tokens, loss_mask, weights))

    param_grads, c_all, d_logits, loss = backward(model, tokens, loss_of, layers)
    full = flat_grads(param_grads, params)
    if model.myopic != "none" or all(k == model.cfg.n_layer for k in layers):
        return full, c_all, c_all, param_grads, loss  # a myopic loss, or any loss at the last layer, reaches r^k_i
        # only from i
    c_own = {k: torch.zeros_like(c_all[k]) for k in layers}
    for k in layers:
        if k == model.cfg.n_layer:
            c_own[k] = c_all[k]
            continue
        pos = torch.tensor(sorted({s.pos for s in sites if s.layer == k}))  # on the CPU (indices, no device sync)
        for chunk in pos.split(16):  # bounds the [rows, batch, vocab] cotangents
            at = chunk.to(tokens.device)
            c_own[k][:, at] = own_cotangents(primals, k, chunk, d_logits[:, at].transpose(0, 1)).transpose(0, 1)
    return full, c_all, c_own, param_grads, loss


def _autograd_backward(model: GPT, tokens, loss_of, layers):
    """(per-parameter gradients, {k: ∂L/∂r^k} [batch, pos, d_model], ∂L/∂logits [batch, pos, vocab], the loss
    ``loss_of(logits)``) by one ``torch.autograd.grad``: the ops of ``training.train_step``, so the parameter gradients are its bits."""
    params = list(model.parameters())
    logits, resid = model.run_with_resid(tokens)
    loss = loss_of(logits)
    grads = torch.autograd.grad(loss, params + [resid[k] for k in layers] + [logits], allow_unused=True)
    c_all = {k: g if g is not None else torch.zeros_like(resid[k]) for k, g in zip(layers, grads[len(params):])}
    return grads[:len(params)], c_all, grads[-1], loss.detach()


def _functional_backward(model: GPT, tokens, loss_of, layers):
    """As :func:`_autograd_backward`, by ``torch.func.vjp`` (which ``vmap`` sees through, ``torch.autograd`` does
    not): the loss as a function of the parameters and of zero perturbations added to each r^k (by the hook after
    its block, or after the token embedding for k = 0), whose cotangents are ∂L/∂r^k."""
    named = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    points = [model.hook_embed if k == 0 else cast(HookPoint, model.blocks[k - 1].hook_resid_post) for k in layers]

    def loss_at(values, zeros):
        handles = [pt.add_hook(lambda act, _hook, z=z: act + z) for pt, z in zip(points, zeros)]
        try:
            logits = torch.func.functional_call(model, ({**dict(zip(named, values)), **buffers}), (tokens,))
        finally:
            for h in handles:
                h.remove()
        return loss_of(logits), logits

    zeros = [tokens.new_zeros((*tokens.shape, model.cfg.d_model), dtype=next(iter(named.values())).dtype)
             for _ in layers]
    loss, pull, logits = cast(tuple, torch.func.vjp(loss_at, tuple(named.values()), zeros, has_aux=True))
    grads, c_all = pull(torch.ones_like(loss))
    d_logits = torch.func.grad(loss_of)(logits)
    return grads, dict(zip(layers, c_all)), d_logits, loss.detach()


class SitePasses:
    """The decomposition of one batch, site by site (what ``decompose`` and the influence tracker share).

    The constructor runs the ordinary backward and the own-position cotangents (``_cotangent_pass``) and caches one
    ordinary forward without a graph (``primals``, ``forward_mode.Primals`` over positions ≤ the last site's).
    ``run_many(sites)`` then gives the sites' direct and pre-cached gradients by the hand-written reverse mode on that
    cache (``reverse_mode.site_vjps``, in the model's own regime): no prefix forward is re-run, and the sites of one
    call (one layer, any positions) share every kernel.
    """

    def __init__(self, model: GPT, tokens: torch.Tensor, sites: Sequence[Site], loss_mask: torch.Tensor | None = None,
                 functional: bool = False, weights: torch.Tensor | None = None):
        for s in sites:
            s.check(model.cfg.n_layer, tokens.shape[1])
        self.model, self.tokens = model, tokens
        self.params = list(model.parameters())
        self.n_params = sum(p.numel() for p in self.params)
        self.primals = Primals(model, tokens[:, :max(s.pos for s in sites) + 1])
        self.full, self.c_all, self.c_own, self.param_grads, self.loss = _cotangent_pass(
            model, tokens, loss_mask, sites, self.primals, functional, weights)

    def has_pre_cached(self, site: Site) -> bool:
        """False where pre-caching is structurally zero: a myopic model, or the last layer (only ln_final reads it)."""
        return self.model.myopic == "none" and site.layer < self.model.cfg.n_layer

    def run(self, site: Site) -> torch.Tensor:
        """The site's direct and pre-cached gradients [2, n_params]."""
        return self.run_many([site])[0]

    def run_many(self, sites: Sequence[Site]) -> torch.Tensor:
        """Direct and pre-cached gradients of sites of one layer [n_sites, 2, n_params] (pre-cached rows exactly 0
        where ``has_pre_cached`` is False), from one call of the reverse mode (rows: the sites × their cotangents
        ∂L_i/∂r^k_i and ∂L/∂r^k_i − ∂L_i/∂r^k_i, each [batch, d_model])."""
        (k,) = {s.layer for s in sites}
        pos = torch.tensor([s.pos for s in sites])  # on the CPU (indices, no device sync)
        at = pos.to(self.tokens.device)
        own = self.c_own[k][:, at].transpose(0, 1)  # [n, batch, d]
        out = self.full.new_zeros((len(sites), 2, self.n_params))
        if self.has_pre_cached(sites[0]):
            cots = torch.stack([own, self.c_all[k][:, at].transpose(0, 1) - own], 1).flatten(0, 1)
            out.view(-1, self.n_params)[:] = site_vjps(self.primals, k, pos.repeat_interleave(2), cots,
                                                       self.model.myopic)
        else:
            out[:, 0] = site_vjps(self.primals, k, pos, own, self.model.myopic)
        return out


def decompose(
    model: GPT, tokens: Tokens, sites: Sequence[Site], loss_mask: Mask | None = None,
    bucket_width: int | None = None,
) -> dict[Site, Components]:
    """Split the training gradient at each site into direct, pre-cached and shared parts (module docstring).

    Args:
        model: a GPT in any regime (vanilla, myopic, untied, split). Its ``.grad`` fields are not touched.
        tokens: [batch, pos]; loss_mask: bool [batch, pos] or None (see ``per_position_loss``).
        sites: residual sites ⟨layer, pos⟩, layer in 0..n_layer.
        bucket_width: sites of one layer whose positions span less than this share one reverse-mode call (None: 1
            on a CPU, where a shorter prefix padded to the longest costs FLOPs, 4 elsewhere).
    Returns:
        {site: Components}, each gradient a flat vector [n_params] in ``model.parameters()`` order.
    """
    sites = list(dict.fromkeys(sites))
    passes = SitePasses(model, tokens, sites, loss_mask)
    width = bucket_width or (1 if tokens.device.type == "cpu" else 4)
    out = {}
    for k in sorted({s.layer for s in sites}):
        layer = sorted(s for s in sites if s.layer == k)
        buckets = [[layer[0]]]
        for s in layer[1:]:
            if s.pos - buckets[-1][0].pos < width:
                buckets[-1].append(s)
            else:
                buckets.append([s])
        for bucket in buckets:
            for s, (direct, pre) in zip(bucket, passes.run_many(bucket)):
                out[s] = Components(direct=direct, pre_cached=pre, shared=passes.full - direct - pre, full=passes.full)
    return out
