"""Exact decomposition of the training gradient at residual sites (paper Prop. 3.1).

For a site ⟨k, i⟩ (layer/position convention of ``ntpflow.sites``; the loss at position i predicts token i+1):

    direct     = ∇L_i − ∇L_i^{sg(k,i)}
    pre_cached = Σ_{j≠i} ∇(L_j − L_j^{sg(k,i)})
    shared     = Σ_j ∇L_j^{sg(k,i)}
    full       = ∇L = direct + pre_cached + shared

with L = Σ_j L_j the training loss (``lm_loss``: mean over counted positions of per-position batch means).

How it is computed: ∇L − ∇L^{sg(k,i)} = (∂r^k_i/∂θ)ᵀ ∂L/∂r^k_i, a vector–Jacobian product of the site's residual.
The cotangents of every site come from two backward passes: the ordinary one gives ∂L/∂r^k, and a myopic
(``"kv"``) one gives ∂L_i/∂r^k_i for every position i at once, because under myopic attention no later loss
reaches r^k_i. Each site's VJPs run on the smallest graph that determines it (``GPT.resid_last``).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .loss import lm_loss
from .model import GPT
from .sites import Site


@dataclass
class Components:
    """The four gradients at one site, each a flat vector [n_params] in ``model.parameters()`` order."""

    direct: torch.Tensor
    pre_cached: torch.Tensor
    shared: torch.Tensor
    full: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"direct": self.direct, "pre_cached": self.pre_cached, "shared": self.shared, "full": self.full}


def flat_grads(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], batch: int | None = None):
    """Concatenate per-parameter gradients (None = zero) into [n_params] (or [batch, n_params] if batched)."""
    parts = []
    for g, p in zip(grads, params):
        if g is None:
            g = p.new_zeros(((batch,) if batch is not None else ()) + p.shape)
        parts.append(g.reshape(batch, -1) if batch is not None else g.reshape(-1))
    return torch.cat(parts, dim=-1)


def site_vjp(resid: torch.Tensor, params: Sequence[torch.Tensor], cotangents: torch.Tensor) -> torch.Tensor:
    """VJPs of a residual tensor in the graph: cotangents [n, *resid.shape] -> [n, n_params]."""
    # one ordinary backward per cotangent: on CPU this beats a vmap-batched backward (copies dominate there)
    rows = [flat_grads(torch.autograd.grad(resid, params, grad_outputs=c, retain_graph=True, allow_unused=True),
                       params) for c in cotangents]
    return torch.stack(rows)


def sites_vjp(model: GPT, tokens: torch.Tensor, requests: Sequence[tuple[Site, torch.Tensor]],
              myopic: str | None = None) -> torch.Tensor:
    """VJPs (∂r^k_i/∂θ)ᵀ u for requests ``[(Site(k, i), u [batch, d_model]), ...]`` -> [n_requests, n_params].

    r^k_i depends only on tokens 0..i, and its last block only through query i: each site runs
    ``model.resid_last`` on the prefix ``tokens[:, :i+1]`` (in the model's regime or ``myopic``), and all the
    requests of one site share that graph.
    """
    params = list(model.parameters())
    out: list[torch.Tensor | None] = [None] * len(requests)
    for site in sorted({s for s, _ in requests}):
        r = model.resid_last(tokens[:, :site.pos + 1], site.layer, myopic=myopic)  # [batch, d_model]
        idx = [n for n, (s, _) in enumerate(requests) if s == site]
        for n, v in zip(idx, site_vjp(r, params, torch.stack([requests[n][1] for n in idx]))):
            out[n] = v
    return torch.stack(out) if out else tokens.new_zeros((0, sum(p.numel() for p in params)), dtype=torch.float)


def resid_cotangents(model: GPT, tokens: torch.Tensor, loss_mask: torch.Tensor | None, layers: Sequence[int]):
    """Forward in the model's own regime and the cotangents of the residual layers.

    Returns (full_grad [n_params], c_all {k: ∂L/∂r^k}, c_own {k: ∂L_i/∂r^k_i at every i}), all
    cotangents [batch, pos, d_model].
    """
    params = list(model.parameters())
    logits, resid = model.run_with_resid(tokens)
    loss = lm_loss(logits, tokens, loss_mask)
    grads = torch.autograd.grad(loss, params + [resid[k] for k in layers], allow_unused=True)
    full = flat_grads(grads[:len(params)], params)
    c_all = {k: g if g is not None else torch.zeros_like(resid[k]) for k, g in zip(layers, grads[len(params):])}
    if model.myopic != "none" or all(k == model.cfg.n_layer for k in layers):
        c_own = c_all  # a myopic loss, or any loss at the last layer, reaches r^k_i only from position i
    else:
        logits_m, resid_m = model.run_with_resid(tokens, myopic="kv")
        loss_m = lm_loss(logits_m, tokens, loss_mask)
        g_m = torch.autograd.grad(loss_m, [resid_m[k] for k in layers], allow_unused=True)
        c_own = {k: g if g is not None else torch.zeros_like(resid[k]) for k, g in zip(layers, g_m)}
    return full, c_all, c_own


def decompose(
    model: GPT, tokens: torch.Tensor, sites: Sequence[Site], loss_mask: torch.Tensor | None = None,
) -> dict[Site, Components]:
    """Split the training gradient at each site into direct, pre-cached and shared parts (module docstring).

    Args:
        model: a GPT in any regime (vanilla, myopic, untied, split). Its ``.grad`` fields are not touched.
        tokens: [batch, pos]; loss_mask: bool [batch, pos] or None (see ``per_position_loss``).
        sites: residual sites ⟨layer, pos⟩, layer in 0..n_layer.
    Returns:
        {site: Components}, each gradient a flat vector [n_params] in ``model.parameters()`` order.
    """
    sites = list(dict.fromkeys(sites))
    for s in sites:
        s.check(model.cfg.n_layer, tokens.shape[1])
    layers = sorted({s.layer for s in sites})
    full, c_all, c_own = resid_cotangents(model, tokens, loss_mask, layers)
    # pre-caching is structurally zero in a myopic model and at the last layer (only ln_final reads it)
    jobs = [(s, "direct") for s in sites]
    jobs += [(s, "pre_cached") for s in sites if model.myopic == "none" and s.layer < model.cfg.n_layer]
    requests = [(s, c_own[s.layer][:, s.pos] if c == "direct" else c_all[s.layer][:, s.pos] - c_own[s.layer][:, s.pos])
                for s, c in jobs]
    vectors = dict(zip(jobs, sites_vjp(model, tokens, requests)))
    out = {}
    for s in sites:
        direct = vectors[s, "direct"]
        pre = vectors.get((s, "pre_cached"), torch.zeros_like(full))
        out[s] = Components(direct=direct, pre_cached=pre, shared=full - direct - pre, full=full)
    return out
