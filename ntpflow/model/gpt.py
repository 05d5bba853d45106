"""GPT-2 in plain PyTorch, with myopic attention and position-grouped (untied) parameters.

Layer/position convention (see ``ntpflow.model.sites``): ``resid[0]`` is the embedding sum, ``resid[k]`` the output of
block k-1, ``resid[n_layer]`` the last block's output *before* the final LayerNorm. Logits at position p predict
token p+1.

Every parameter carries a leading *group* axis ``[n_groups, ...]``. Position p uses copy ``groups[p]``; with one
group this is exactly GPT-2. Grouped layers run as one batched matmul over positions, never a loop over them.
"""

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ntpflow.model.config import MYOPIC_MODES, GPTConfig, Groups, Myopic
from ntpflow.model.hf import gpt_from_hf, gpt_from_pretrained, gpt_to_hf, gpt_to_hooked_transformer
from ntpflow.model.hooks import ActivationCache, HookPoint, NamesFilter, name_hook_points, run_with_cache
from ntpflow.model.shapes import Logits, Resid, ResidLast, Tokens
from ntpflow.model.sites import Site


def take_groups(param: torch.Tensor, groups: slice | torch.Tensor) -> torch.Tensor:
    """``param`` [G, ...] -> [pos, ...], the copy of each position's group.

    A slice is a view; an index tensor goes through ``index_select``, whose backward (``index_add``) is
    deterministic on CPU, unlike advanced indexing's (``index_put`` with accumulation).
    """
    return param[groups] if isinstance(groups, slice) else torch.index_select(param, 0, groups)


class GroupedLinear(nn.Module):
    """``y[b, p] = x[b, p] @ weight[g_p].T + bias[g_p]``; weight [G, d_out, d_in], bias [G, d_out]."""

    def __init__(self, n_groups: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_groups, d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(n_groups, d_out))

    def forward(self, x: torch.Tensor, groups: "Groups") -> torch.Tensor:
        """x [batch, pos, d_in], groups: None (single group), a slice or an index [pos] -> [batch, pos, d_out]."""
        if groups is None:
            return F.linear(x, self.weight.squeeze(0), self.bias.squeeze(0))
        w = take_groups(self.weight, groups)  # [pos, d_out, d_in]
        y = torch.baddbmm(take_groups(self.bias, groups).unsqueeze(1), x.transpose(0, 1), w.transpose(1, 2))  # [pos, batch, out]
        return y.transpose(0, 1)


class GroupedLayerNorm(nn.Module):
    """LayerNorm with per-group affine parameters weight, bias [G, d]."""

    def __init__(self, n_groups: int, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_groups, d))
        self.bias = nn.Parameter(torch.zeros(n_groups, d))
        self.hook_normalized = HookPoint()

    def normalize(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """x [batch, pos, d] -> [batch, pos, d], without calling the hook."""
        if groups is None:
            return F.layer_norm(x, x.shape[-1:], self.weight.squeeze(0), self.bias.squeeze(0), self.eps)
        return F.layer_norm(x, x.shape[-1:], None, None, self.eps) * take_groups(self.weight, groups) + take_groups(self.bias, groups)

    def forward(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """x [batch, pos, d] -> [batch, pos, d]. ``hook_normalized`` sees (x - mean) / sqrt(var + eps) [batch, pos,
        d], before the affine weight and bias, as TransformerLens's does. Unless a hook replaces or changes that value,
        the output is the fused LayerNorm's, bit for bit (caching does not move the logits)."""
        if not self.hook_normalized.active:
            return self.normalize(x, groups)
        n = F.layer_norm(x, x.shape[-1:], None, None, self.eps)
        version = n._version  # counts in-place changes
        m = self.hook_normalized(n)
        if m is n and n._version == version:  # the hooks only read it
            return self.normalize(x, groups)
        if groups is None:
            return m * self.weight.squeeze(0) + self.bias.squeeze(0)
        return m * take_groups(self.weight, groups) + take_groups(self.bias, groups)


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped projections and the myopic modes ``"kv"``, ``"resid"``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = GroupedLinear(cfg.n_groups, cfg.d_model, 3 * cfg.d_model)
        self.c_proj = GroupedLinear(cfg.n_groups, cfg.d_model, cfg.d_model)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern, self.hook_z = HookPoint(), HookPoint()

    def _heads(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        b, t, _ = qkv.shape  # -> 3 tensors [batch, pos, head, d_head]
        return [z.reshape(b, t, self.n_head, -1) for z in qkv.chunk(3, dim=-1)]

    def forward(self, x: torch.Tensor, x_in: torch.Tensor, groups, myopic: str, last_only: bool = False):
        """x = ln1(resid) [batch, pos, d_model]; x_in = the stop-gradient input for ``myopic="resid"``.

        ``last_only``: compute the output of the last query position only -> [batch, 1, d_model].
        """
        q, k, v = (h(z) for h, z in zip((self.hook_q, self.hook_k, self.hook_v), self._heads(self.c_attn(x, groups))))
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [batch, head, pos, d_head]
        q_groups = groups
        if last_only:
            q = q[:, :, -1:]
            q_groups = _last(groups)
        if myopic == "none" and not self.hook_pattern.active:
            # on CUDA the plain (math) kernel: the fused ones fail under the run groups' batching (an H200 run:
            # "LSE is not correctly aligned"), and at these lengths they gain little
            with sdpa_kernel(SDPBackend.MATH) if q.is_cuda else nullcontext():
                z = F.scaled_dot_product_attention(q, k, v, is_causal=not last_only)
        else:
            if myopic == "kv":
                k_off, v_off = k.detach(), v.detach()
            elif myopic == "resid":
                _, k_off, v_off = (z.transpose(1, 2) for z in self._heads(self.c_attn(x_in, groups)))
            else:
                k_off, v_off = k, v
            z = _attend(q, k, v, k_off, v_off, self.hook_pattern)
        z = self.hook_z(z.transpose(1, 2))  # [batch, pos, head, d_head]
        return self.c_proj(z.flatten(2), q_groups)


def _attend(q, k, v, k_off, v_off, hook_pattern: HookPoint) -> torch.Tensor:
    """Causal attention where query t uses (k, v) at s == t and (k_off, v_off) at s != t.

    Value-identical to ordinary attention when k_off, v_off equal k, v in value. q [batch, head, q_pos, d_head] holds
    the last q_pos positions of k, v, k_off, v_off [batch, head, pos, d_head].
    """
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    qpos = torch.arange(offset, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    scores = q @ k_off.transpose(-1, -2)
    if k_off is not k:
        scores = torch.where(qpos == kpos, (q * k[:, :, offset:]).sum(-1, keepdim=True), scores)
    scores = (scores / math.sqrt(q.shape[-1])).masked_fill(kpos > qpos, float("-inf"))
    pattern = hook_pattern(scores.softmax(-1))
    out = pattern @ v_off
    if v_off is not v:
        out = out + pattern.diagonal(offset, dim1=-2, dim2=-1).unsqueeze(-1) * (v - v_off)[:, :, offset:]
    return out


class MLP(nn.Module):
    """GELU (tanh) MLP d_model -> 4·d_model -> d_model with grouped weights."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = GroupedLinear(cfg.n_groups, cfg.d_model, 4 * cfg.d_model)
        self.c_proj = GroupedLinear(cfg.n_groups, 4 * cfg.d_model, cfg.d_model)
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()

    def forward(self, x, groups):
        """x [batch, pos, d_model] -> [batch, pos, d_model]."""
        return self.c_proj(self.hook_post(F.gelu(self.hook_pre(self.c_fc(x, groups)), approximate="tanh")), groups)


class Block(nn.Module):
    """Pre-LayerNorm GPT-2 block: resid[k] -> resid[k+1] (attention, then MLP, each added to the residual)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = GroupedLayerNorm(cfg.n_groups, cfg.d_model, cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = GroupedLayerNorm(cfg.n_groups, cfg.d_model, cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.hook_resid_pre, self.hook_resid_mid, self.hook_resid_post = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_out, self.hook_mlp_out = HookPoint(), HookPoint()

    def forward(self, resid, groups, myopic: str, last_only: bool = False):
        """resid [batch, pos, d_model] -> [batch, pos, d_model], or [batch, 1, d_model] for the last position only."""
        resid = self.hook_resid_pre(resid)
        x = self.ln1(resid, groups)
        x_in = self.ln1.normalize(resid.detach(), groups) if myopic == "resid" else x
        attn = self.attn(x, x_in, groups, myopic, last_only)
        if last_only:
            resid, groups = resid[:, -1:], _last(groups)
        resid = self.hook_resid_mid(resid + self.hook_attn_out(attn))
        return self.hook_resid_post(resid + self.hook_mlp_out(self.mlp(self.ln2(resid, groups), groups)))


class GPT(nn.Module):
    """GPT-2 with myopic attention and position groups.

    ``GPT(cfg, seed=0)`` initialises N(0, 0.02) weights (residual output projections scaled by 1/sqrt(2·n_layer))
    from its own generator on the CPU; all position groups start identical.
    """

    groups: torch.Tensor  # buffer [n_ctx]: each position's parameter group (cfg.groups)

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        G = cfg.n_groups
        self.wte = nn.Parameter(torch.empty(G, cfg.vocab_size, cfg.d_model))
        self.wpe = nn.Parameter(torch.empty(G, cfg.n_ctx, cfg.d_model))
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_final = GroupedLayerNorm(G, cfg.d_model, cfg.layer_norm_eps)
        self.register_buffer("groups", torch.tensor(cfg.groups, dtype=torch.long), persistent=False)
        name_hook_points(self)
        self._init_weights(seed)

    @property
    def myopic(self) -> str:
        """The model's default myopic mode (``cfg.myopic``)."""
        return self.cfg.myopic

    @torch.no_grad()
    def _init_weights(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        proj_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                std = proj_std
            elif name in ("wte", "wpe") or name.endswith(".weight") and p.dim() == 3:
                std = 0.02
            else:
                continue  # biases zero, LayerNorm weight one (set in constructors)
            one = torch.randn(p.shape[1:], generator=gen) * std
            p.copy_(one.expand_as(p))

    def _groups(self, t: int) -> Groups:
        """Group index of positions 0..t-1: None (one group), a slice (one group per position: parameters are
        sliced, not gathered) or a tensor [t]."""
        if self.cfg.n_groups == 1:
            return None
        if self.cfg.groups == tuple(range(self.cfg.n_ctx)):
            return slice(0, t)
        return self.groups[:t]

    @overload
    def forward(self, tokens: Tokens, *, stop_grad_at: Sequence[Site] = (), myopic: Myopic | None = None,
                return_resid: Literal[False] = False) -> Logits: ...
    @overload
    def forward(self, tokens: Tokens, *, stop_grad_at: Sequence[Site] = (), myopic: Myopic | None = None,
                return_resid: Literal[True]) -> tuple[Logits, list[Resid]]: ...
    def forward(
        self,
        tokens: Tokens,
        *,
        stop_grad_at: Sequence[Site] = (),
        myopic: Myopic | None = None,
        return_resid: bool = False,
    ) -> Logits | tuple[Logits, list[Resid]]:
        """tokens [batch, pos] -> logits [batch, pos, vocab] (position p predicts token p+1).

        Args:
            stop_grad_at: residual sites whose gradient is blocked (forward values unchanged): sg(k, i) of the paper.
            myopic: override the model's myopic mode for this call (e.g. ``"none"`` for a true-sensitivity forward).
            return_resid: also return ``resid``, a list of n_layer+1 tensors [batch, pos, d_model] in the graph.
        """
        cfg = self.cfg
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, pos], got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > cfg.n_ctx:
            raise ValueError(f"sequence length {t} exceeds n_ctx={cfg.n_ctx}")
        mode = cfg.myopic if myopic is None else myopic
        if mode not in MYOPIC_MODES:
            raise ValueError(f"unknown myopic mode {mode!r}; choose one of {MYOPIC_MODES}")
        stops = _stop_masks(stop_grad_at, cfg.n_layer, t, tokens.device)
        groups = self._groups(t)
        resid = self._embed(tokens, groups)
        resids = []
        for k in range(cfg.n_layer + 1):
            if k in stops:
                resid = torch.where(stops[k], resid.detach(), resid)
            resids.append(resid)
            if k < cfg.n_layer:
                resid = self.blocks[k](resid, groups, mode)
        logits = self.unembed(resid, groups)
        return (logits, resids) if return_resid else logits

    def unembed(self, resid: Resid, groups: Groups) -> Logits:
        """Final LayerNorm and tied unembedding: resid[n_layer] [batch, pos, d_model] -> logits [batch, pos, vocab];
        ``groups``: the positions' group index (see ``_groups``)."""
        x = self.ln_final(resid, groups)
        if groups is None:
            return x @ self.wte.squeeze(0).T
        return torch.bmm(x.transpose(0, 1), take_groups(self.wte, groups).transpose(1, 2)).transpose(0, 1)

    def _embed(self, tokens: Tokens, groups: Groups) -> Resid:
        """tokens [batch, pos] -> resid[0] = token + position embedding [batch, pos, d_model]."""
        t = tokens.shape[1]
        if groups is None:
            tok, pe = F.embedding(tokens, self.wte.squeeze(0)), self.wpe.squeeze(0)[:t]
        else:
            # flat lookups: F.embedding's backward is deterministic, advanced indexing's is not
            n_groups, vocab, d = self.wte.shape
            pos = torch.arange(t, device=tokens.device)
            g = pos if isinstance(groups, slice) else groups
            tok = F.embedding(g * vocab + tokens, self.wte.reshape(n_groups * vocab, d))
            pe = F.embedding(g * self.cfg.n_ctx + pos, self.wpe.reshape(n_groups * self.cfg.n_ctx, d))
        return self.hook_embed(tok) + self.hook_pos_embed(pe.expand_as(tok))  # TL's shapes: [batch, pos, d_model]

    def resid_last(self, tokens: Tokens, layer: int, *, myopic: Myopic | None = None) -> ResidLast:
        """``resid[layer]`` at the last position of ``tokens`` [batch, pos] -> [batch, d_model], in the graph.

        Computes only what that residual depends on: the last block runs for the last query position alone.
        """
        if not 0 <= layer <= self.cfg.n_layer:
            raise ValueError(f"layer {layer} out of range 0..{self.cfg.n_layer}")
        mode = self.cfg.myopic if myopic is None else myopic
        groups = self._groups(tokens.shape[1])
        resid = self._embed(tokens, groups)
        for k in range(layer):
            resid = self.blocks[k](resid, groups, mode, last_only=k == layer - 1)
        return resid[:, -1]

    def run_with_resid(self, tokens: Tokens, **kwargs: Any) -> tuple[Logits, list[Resid]]:
        """(logits [batch, pos, vocab], resid list of n_layer+1 [batch, pos, d_model]), residuals in the graph."""
        return self(tokens, return_resid=True, **kwargs)

    # ---- conversion to and from transformers.GPT2LMHeadModel ----
    def run_with_cache(
        self,
        tokens: Tokens,
        names: NamesFilter = None,
        *,
        names_filter: NamesFilter = None,
        **kwargs: Any,
    ) -> tuple[Logits, ActivationCache]:
        """``(logits, cache)``: the forward on ``tokens`` [batch, pos] with every hook point's activation (or those
        ``names_filter`` selects: a name, a list of names or a callable ``name -> bool``, as TransformerLens takes it;
        ``names`` is the same) in an :class:`~ntpflow.model.hooks.ActivationCache`, indexed like TransformerLens's
        (``cache["resid_pre", 1]``, ``cache["resid_post", -1]``)."""
        return run_with_cache(self, tokens, names, names_filter=names_filter, **kwargs)

    def to_hf(self):
        """Return an equivalent ``transformers.GPT2LMHeadModel`` (single position group only)."""
        return gpt_to_hf(self)

    @classmethod
    def from_hf(cls, hf_model, **overrides) -> "GPT":
        """Build a GPT from a ``transformers.GPT2LMHeadModel``; ``overrides`` may set e.g. ``myopic``."""
        return gpt_from_hf(cls, hf_model, **overrides)

    @classmethod
    def from_pretrained(cls, name_or_path, **overrides) -> "GPT":
        """A GPT with the weights of: an ntpflow run folder (its final weights, its own config: myopic, position
        groups), a GPT-2 folder written by :meth:`save_pretrained`, ``Run.export`` or ``transformers``, or a hub name
        such as ``gpt2`` where the hub is reachable. ``overrides`` go to GPTConfig. Anything else (a missing folder,
        an unfinished run, a TransformerLens folder, a file whose tensors do not fit: names, shapes, dtype) is a
        one-line ValueError saying what is wrong or what to call instead."""
        return gpt_from_pretrained(cls, name_or_path, **overrides)

    def save_pretrained(self, path) -> None:
        """Write the weights (``model.safetensors``) and ``config.json`` in the layout of ``transformers``'s
        ``GPT2LMHeadModel``, which loads it as it is (one position group only; no optimizer state)."""
        self.to_hf().save_pretrained(path, safe_serialization=True)

    def to_hooked_transformer(self):
        """An equivalent TransformerLens ``HookedTransformer`` (one position group only), same logits to float
        rounding; its hooks carry TransformerLens's names and shapes."""
        return gpt_to_hooked_transformer(self)


def _last(groups: Groups) -> Groups:
    """The group index of the last position only."""
    if groups is None:
        return None
    if isinstance(groups, slice):
        return slice(groups.stop - 1, groups.stop)
    return groups[-1:]


def _stop_masks(sites: Sequence[Site], n_layer: int, t: int, device) -> dict[int, torch.Tensor]:
    """{layer: bool mask [pos, 1]} of the positions whose residual is stop-gradiented."""
    masks: dict[int, torch.Tensor] = {}
    for s in sites:
        s.check(n_layer, t)
        if s.layer not in masks:
            masks[s.layer] = torch.zeros(t, 1, dtype=torch.bool, device=device)
        masks[s.layer][s.pos] = True
    return masks
