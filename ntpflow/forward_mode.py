"""Hand-written forward mode over the GPT's own blocks: residual tangents J·δ along parameter directions.

For a residual ``resid[k]`` (layer/position convention of ``ntpflow.sites``: ``resid[k]`` is the output of block
k−1; logits at p predict token p+1) and parameter directions δ_j (flat [n_params] rows in ``model.parameters()``
order), ``J δ_j`` with ``J = ∂resid[k]/∂θ`` is the directional derivative of the **ordinary** (non-myopic) forward.

``Primals(model, tokens)`` runs that forward once without a graph and keeps what the tangent rules need (LayerNorm
statistics, q/k/v, attention probabilities, GELU slopes, every linear layer's input). By causality its values at
positions ≤ i are exactly those of the prefix ``tokens[:, :i+1]``, so one cache serves every site:
``site_tangents(primals, k, i, D)`` propagates m directions [m, n_params] through the blocks below k over positions
≤ i, and through block k−1 for query i alone (keys and values over ≤ i). All m directions travel in one leading
axis, so each layer is a few large matmuls. FLOPs per direction ≈ 2× a forward of that prefix (a linear layer's
tangent is ẋWᵀ + xẆᵀ + ḃ).

Why forward mode: a probe risk R with per-example cotangent c at the residual has ``∇θR · δ = c · (J δ)``, so the
tangents of a site's few update directions serve any number of probes, mismatches and type subsets, and no per-risk
gradient vector [n_params] is formed.
"""

import math

import torch
import torch.nn.functional as F

from .model import GPT

_GELU_C = math.sqrt(2 / math.pi)


class _Params:
    """A model's parameters (or a batch of m parameter directions) by name, with each position's group copy."""

    def __init__(self, flat: dict[str, torch.Tensor], groups: torch.Tensor | None, lead: int):
        self.flat, self.groups, self.lead = flat, groups, lead  # lead: number of leading (direction) axes, 0 or 1

    def at(self, name: str, pos: slice | int) -> torch.Tensor:
        """The copy of parameter ``name`` at positions ``pos``: [*lead, *shape] (shared) or [*lead, npos, *shape]."""
        p = self.flat[name]
        if self.groups is None:
            return p[(slice(None),) * self.lead + (0,)]
        idx = self.groups[pos] if isinstance(pos, slice) else self.groups[pos:pos + 1]
        return p.index_select(self.lead, idx)


def _lin(x: torch.Tensor, w: torch.Tensor, shared: bool) -> torch.Tensor:
    """x [..., pos, in] times the weight w: [out, in] (shared), [pos, out, in] (per position), [m, out, in] or
    [m, pos, out, in] (per direction; x then gains a leading m axis in the result) -> [(m,) ..., pos, out]."""
    if w.dim() == 2:
        return x @ w.T
    if shared:  # w [m, out, in], x [..., pos, in] -> [m, ..., pos, out]
        return torch.einsum("...pi,moi->m...po", x, w)
    if w.dim() == 3:  # per position, x may carry a leading m axis
        return torch.einsum("...pi,poi->...po", x, w)
    return torch.einsum("...pi,mpoi->m...po", x, w)


def _bias(b: torch.Tensor, shared: bool, lead: int) -> torch.Tensor:
    """A bias [*lead, out] or [*lead, pos, out] shaped to broadcast against [*lead, batch, pos, out]."""
    if shared:
        return b.reshape(*b.shape[:lead], 1, 1, b.shape[-1])
    return b.unsqueeze(lead)


class Primals:
    """The ordinary forward of ``model`` on ``tokens`` [batch, pos], with what the tangent rules need (no graph).

    ``resid[k]``: [batch, pos, d_model] for k = 0..n_layer (same convention as ``GPT.forward``).
    """

    def __init__(self, model: GPT, tokens: torch.Tensor):
        cfg = model.cfg
        self.model, self.tokens = model, tokens
        self.n_head, self.eps = cfg.n_head, cfg.layer_norm_eps
        t = tokens.shape[1]
        self.shared = cfg.n_groups == 1
        self.groups = None if self.shared else model.groups[:t]
        self.names = [n for n, _ in model.named_parameters()]
        with torch.no_grad():
            p = _Params(dict(model.named_parameters()), self.groups, 0)
            all_pos = slice(0, t)
            pos = torch.arange(t, device=tokens.device)
            if self.shared:
                r = F.embedding(tokens, p.at("wte", all_pos)) + p.at("wpe", all_pos)[:t]
            else:
                vocab, d = model.wte.shape[1:]
                r = (F.embedding(self.groups * vocab + tokens, model.wte.reshape(-1, d))
                     + F.embedding(self.groups * cfg.n_ctx + pos, model.wpe.reshape(-1, d)))
            self.resid, self.blocks = [r], []
            for b in range(cfg.n_layer):
                c = self._block(p, f"blocks.{b}.", r)
                self.blocks.append(c)
                r = c["out"]
                self.resid.append(r)

    def _ln(self, p: _Params, name: str, x: torch.Tensor) -> dict:
        mu = x.mean(-1, keepdim=True)
        sigma = (x - mu).pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
        n = (x - mu) / sigma
        w, b = p.at(name + "weight", slice(0, x.shape[1])), p.at(name + "bias", slice(0, x.shape[1]))
        return {"n": n, "rsigma": 1 / sigma, "y": n * w + b}

    def _linear(self, p: _Params, name: str, x: torch.Tensor) -> torch.Tensor:
        s = slice(0, x.shape[1])
        return _lin(x, p.at(name + "weight", s), self.shared) + _bias(p.at(name + "bias", s), self.shared, 0)

    def _block(self, p: _Params, pre: str, r: torch.Tensor) -> dict:
        bsz, t, d = r.shape
        c = {"in": r, "ln1": self._ln(p, pre + "ln1.", r)}
        qkv = self._linear(p, pre + "attn.c_attn.", c["ln1"]["y"])
        q, k, v = (z.reshape(bsz, t, self.n_head, -1).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=r.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [batch, head, q, k]
        z = (att @ v).transpose(1, 2).reshape(bsz, t, d)
        mid = r + self._linear(p, pre + "attn.c_proj.", z)
        c.update(q=q, k=k, v=v, att=att, z=z, mid=mid, ln2=self._ln(p, pre + "ln2.", mid))
        a = self._linear(p, pre + "mlp.c_fc.", c["ln2"]["y"])
        th = torch.tanh(_GELU_C * (a + 0.044715 * a.pow(3)))
        c["h"] = 0.5 * a * (1 + th)
        c["gelu_slope"] = 0.5 * (1 + th) + 0.5 * a * (1 - th * th) * _GELU_C * (1 + 3 * 0.044715 * a * a)
        c["out"] = mid + self._linear(p, pre + "mlp.c_proj.", c["h"])
        return c

    def params(self) -> _Params:
        """The model's parameters by name."""
        return _Params(dict(self.model.named_parameters()), self.groups, 0)

    def directions(self, flat: torch.Tensor) -> _Params:
        """Flat directions [m, n_params] -> per-parameter views [m, *param.shape], by name."""
        params = list(self.model.parameters())
        views = flat.split([p.numel() for p in params], dim=1)
        return _Params({n: v.view(len(flat), *p.shape) for n, v, p in zip(self.names, views, params)}, self.groups, 1)


def _ln_tangent(c: dict, dp: _Params, p_w: torch.Tensor, name: str, dx: torch.Tensor, pos: slice) -> torch.Tensor:
    """Tangent of a LayerNorm output: dx [m, batch, P, d] at positions ``pos`` -> [m, batch, P, d]."""
    n, rsigma = c["n"][:, pos], c["rsigma"][:, pos]
    dn = (dx - dx.mean(-1, keepdim=True) - n * (n * dx).mean(-1, keepdim=True)) * rsigma
    dw, db = dp.at(name + "weight", pos), dp.at(name + "bias", pos)
    if dp.groups is None:
        dw, db = dw[:, None, None], db[:, None, None]
    else:
        dw, db = dw[:, None], db[:, None]
    return dn * p_w + n * dw + db


def site_tangents(primals: Primals, layer: int, pos: int, directions: torch.Tensor) -> torch.Tensor:
    """Tangents of ``resid[layer][:, pos]`` along ``directions`` [m, n_params] -> [m, batch, d_model].

    Blocks below ``layer − 1`` run over positions ≤ pos, block ``layer − 1`` for query ``pos`` alone.
    """
    p, dp = primals.params(), primals.directions(directions)
    with torch.no_grad():
        dr = _embed_tangent(primals, dp, pos)
        for b in range(layer):
            dr = _block_tangent(primals, p, dp, b, dr, pos, last=b == layer - 1)
    return dr[:, :, -1]


def all_tangents(primals: Primals, n_layers: int, n_pos: int, directions: torch.Tensor) -> list[torch.Tensor]:
    """Tangents of ``resid[0..n_layers]`` at positions < n_pos along ``directions`` [m, n_params]: a list of
    [m, batch, n_pos, d_model]. By causality, position i's tangent is the one of the prefix ending at i, so one
    call serves every site (e.g. along the full gradient and the full Adam step)."""
    p, dp = primals.params(), primals.directions(directions)
    with torch.no_grad():
        out = [_embed_tangent(primals, dp, n_pos - 1)]
        for b in range(n_layers):
            out.append(_block_tangent(primals, p, dp, b, out[-1], n_pos - 1, last=False))
    return out


def _embed_tangent(pr: Primals, dp: _Params, pos: int) -> torch.Tensor:
    """ṙ0[b, p] = δwte[g_p, tok[b, p]] + δwpe[g_p, p] at positions ≤ pos -> [m, batch, pos+1, d]."""
    tok = pr.tokens[:, :pos + 1]
    positions = torch.arange(pos + 1, device=tok.device)
    g = torch.zeros_like(positions) if pr.groups is None else pr.groups[:pos + 1]
    return dp.flat["wte"][:, g[None, :], tok] + dp.flat["wpe"][:, g, positions][:, None]


def _block_tangent(pr: Primals, p: _Params, dp: _Params, b: int, dr: torch.Tensor, pos: int, last: bool):
    """Tangent through block b: dr [m, batch, P, d] at positions 0..pos -> [m, batch, P or 1, d]."""
    c, pre, shared = pr.blocks[b], f"blocks.{b}.", pr.shared
    upto = slice(0, pos + 1)
    q_pos = slice(pos, pos + 1) if last else upto  # query positions computed

    def lin(name, x, dx, s):  # tangent of a linear layer at positions s: ẋWᵀ + xẆᵀ + ḃ
        return (_lin(dx, p.at(name + "weight", s), shared) + _lin(x, dp.at(name + "weight", s), shared)
                + _bias(dp.at(name + "bias", s), shared, 1))

    m, bsz = dr.shape[:2]
    dx1 = _ln_tangent(c["ln1"], dp, p.at(pre + "ln1.weight", upto), pre + "ln1.", dr, upto)
    x1 = c["ln1"]["y"][:, upto]
    if last and shared:
        dz = _query_attention_tangent(pr, p, dp, b, x1, dx1, pos)
    else:
        dz = _attention_tangent(pr, c, lin(pre + "attn.c_attn.", x1, dx1, upto), q_pos, upto)
    z = c["z"][:, q_pos]
    dmid = dr[:, :, -1:] if last else dr
    dmid = dmid + lin(pre + "attn.c_proj.", z, dz, q_pos)
    dx2 = _ln_tangent(c["ln2"], dp, p.at(pre + "ln2.weight", q_pos), pre + "ln2.", dmid, q_pos)
    x2 = c["ln2"]["y"][:, q_pos]
    da = lin(pre + "mlp.c_fc.", x2, dx2, q_pos)
    dh = da * c["gelu_slope"][:, q_pos]
    return dmid + lin(pre + "mlp.c_proj.", c["h"][:, q_pos], dh, q_pos)


def _attention_tangent(pr: Primals, c: dict, dqkv: torch.Tensor, q_pos: slice, upto: slice) -> torch.Tensor:
    """Attention output tangent [m, batch, Q, d] from the q/k/v tangents dqkv [m, batch, P, 3d] (q used at q_pos)."""
    m, bsz = dqkv.shape[:2]
    dq, dk, dv = dqkv.chunk(3, dim=-1)
    dq = dq[:, :, q_pos]  # the last block: q at the query position only; k, v at every position ≤ pos
    heads = pr.n_head

    def split(z):  # [m, batch, P, d] -> [m, batch, head, P, d_head]
        return z.reshape(*z.shape[:3], heads, -1).transpose(2, 3)

    dq, dk, dv = split(dq), split(dk), split(dv)
    q, k, v = c["q"][:, :, q_pos], c["k"][:, :, upto], c["v"][:, :, upto]
    att = c["att"][:, :, q_pos, upto]  # rows sum to 1 over keys ≤ query (masked entries are exactly 0)
    scale = 1 / math.sqrt(q.shape[-1])
    ds = (dq @ k.transpose(-1, -2) + q @ dk.transpose(-1, -2)) * scale
    datt = att * (ds - (att * ds).sum(-1, keepdim=True))
    dz = datt @ v + att @ dv  # [m, batch, head, Q, d_head]
    return dz.transpose(2, 3).reshape(m, bsz, -1, heads * dz.shape[-1])


def _query_attention_tangent(pr: Primals, p: _Params, dp: _Params, b: int, x1: torch.Tensor, dx1: torch.Tensor,
                             pos: int) -> torch.Tensor:
    """Attention output tangent at query ``pos`` alone [m, batch, 1, d], single-group parameters.

    Keys and values enter only through q·k̇ and Σ_t A_t v̇_t, so they regroup per head: with a = W_kᵀq and
    y = Σ_t A_t x1_t computed once, the direction-dependent work is O(m·batch·(d² + head·P·d)) instead of the
    O(m·batch·P·d²) of k̇ and v̇ at every position. x1, dx1: ln1 output [batch, P, d] and its tangent [m, batch, P, d].
    """
    c, name, heads = pr.blocks[b], f"blocks.{b}.attn.c_attn.", pr.n_head
    d = x1.shape[-1]
    w, dw = p.at(name + "weight", 0), dp.at(name + "weight", 0)  # [3d, d], [m, 3d, d]
    bias_dot = dp.at(name + "bias", 0)  # [m, 3d]
    m, dh = len(dw), d // heads
    w_k, w_v = w[d:2 * d].view(heads, dh, d), w[2 * d:].view(heads, dh, d)
    dw_k, dw_v = dw[:, d:2 * d].view(m, heads, dh, d), dw[:, 2 * d:].view(m, heads, dh, d)
    q, k, v = c["q"][:, :, pos], c["k"][:, :, :pos + 1], c["v"][:, :, :pos + 1]  # [B, H, dh], [B, H, P, dh]
    att = c["att"][:, :, pos, :pos + 1]  # [B, H, P]
    dq = (dx1[:, :, -1] @ w[:d].T + x1[:, -1] @ dw[:, :d].transpose(1, 2) + bias_dot[:, None, :d])
    dq = dq.view(m, -1, heads, dh)  # [m, B, H, dh]
    a = torch.einsum("bhe,hed->bhd", q, w_k)  # W_kᵀ q per head
    ds = (torch.einsum("mbhe,bhte->mbht", dq, k) + torch.einsum("bhd,mbtd->mbht", a, dx1)
          + torch.einsum("mbhd,btd->mbht", torch.einsum("bhe,mhed->mbhd", q, dw_k), x1)
          + torch.einsum("bhe,mhe->mbh", q, bias_dot[:, d:2 * d].view(m, heads, dh))[..., None]) / math.sqrt(dh)
    datt = att * (ds - (att * ds).sum(-1, keepdim=True))
    y = torch.einsum("bht,btd->bhd", att, x1)  # Σ_t A_t x1_t (rows of A sum to 1)
    dz = (torch.einsum("mbht,bhte->mbhe", datt, v) + torch.einsum("hed,mbhd->mbhe", w_v,
                                                                   torch.einsum("bht,mbtd->mbhd", att, dx1))
          + torch.einsum("mhed,bhd->mbhe", dw_v, y) + bias_dot[:, None, 2 * d:].view(m, 1, heads, dh))
    return dz.reshape(m, -1, 1, d)
