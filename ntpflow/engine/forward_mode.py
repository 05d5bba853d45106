"""Hand-written forward mode over the GPT's own blocks: residual tangents J·δ along parameter directions.

For a residual ``resid[k]`` (layer/position convention of ``ntpflow.model.sites``: ``resid[k]`` is the output of block
k−1; logits at p predict token p+1) and parameter directions δ_j (flat [n_params] rows in ``model.parameters()``
order), ``J δ_j`` with ``J = ∂resid[k]/∂θ`` is the directional derivative of the **ordinary** (non-myopic) forward.

``Primals(model, tokens)`` runs that forward once without a graph and keeps what the tangent rules need (LayerNorm
statistics, q/k/v, attention probabilities, GELU slopes, every linear layer's input). By causality its values at
positions ≤ i are exactly those of the prefix ``tokens[:, :i+1]``, so one cache serves every site:
``site_tangents(primals, k, i, D)`` propagates m directions [m, n_params] through the blocks below k over positions
≤ i, and through block k−1 for query i alone (keys and values over ≤ i); ``i`` may differ per direction (a bucket of
sites of one layer: the lower blocks then run over positions ≤ max i). All m directions travel in one leading
axis, so each layer is a few large matmuls. FLOPs per direction ≈ 2× a forward of that prefix (a linear layer's
tangent is ẋWᵀ + xẆᵀ + ḃ).

Why forward mode: a probe risk R with per-example cotangent c at the residual has ``∇θR · δ = c · (J δ)``, so the
tangents of a site's few update directions serve any number of probes, mismatches and type subsets, and no per-risk
gradient vector [n_params] is formed.
"""

import math

import torch
import torch.nn.functional as F

from ntpflow.model.gpt import GPT


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

    ``resid[k]``: [batch, pos, d_model] for k = 0..n_layer (same convention as ``GPT.forward``); ``n_layer``: run
    only the blocks below it (default: all), for a reader of no higher residual (tangents and risks at sites of layer
    ≤ n_layer): ``resid`` then stops at ``resid[n_layer]``, with the same values.

    **Embedding table.** Block 0's input resid[0][b, p] depends on (token, position) only, so its ln1 and its q/k/v
    projection (a quarter of the block's matmuls) take at most vocab distinct rows per position. When the vocabulary
    is smaller than the batch, the cache keeps them once per (token, position) in a table of ``table_tokens``
    [R, pos] (R = vocab; else R = batch and the table is the batch itself), and the reverse and forward modes run
    block 0's ln1 and c_attn on the table: tangents are computed per table row and gathered (``gather``), cotangents
    are summed into table rows (``bin``) before the weight gradients. Exact: sums are only regrouped.
    """

    def __init__(self, model: GPT, tokens: torch.Tensor, n_layer: int | None = None):
        cfg = model.cfg
        self.model, self.tokens = model, tokens
        self.n_head, self.eps = cfg.n_head, cfg.layer_norm_eps
        bsz, t = tokens.shape
        self.shared = cfg.n_groups == 1
        self.groups = None if self.shared else model.groups[:t]
        self.named: dict[str, torch.Tensor] = dict(model.named_parameters())  # by name, in model.parameters() order
        self.names = list(self.named)
        self.vocab = model.wte.shape[1]
        self.dedupe = self.vocab < bsz
        self.table_tokens = (torch.arange(self.vocab, device=tokens.device)[:, None].expand(-1, t) if self.dedupe
                             else tokens)  # [R, t]
        self._rows: dict = {}  # gather indices by prefix length (and layout)
        with torch.no_grad():
            p = _Params(self.named, self.groups, 0)
            r_tab = self.embed(self.table_tokens)
            r = self.gather(r_tab)
            self.resid, self.blocks = [r], []
            for b in range(cfg.n_layer if n_layer is None else n_layer):
                c = self._block(p, f"blocks.{b}.", r, r_tab if b == 0 else None)
                self.blocks.append(c)
                r = c["out"]
                self.resid.append(r)

    def embed(self, tok: torch.Tensor) -> torch.Tensor:
        """resid[0] of tokens [R, pos] (positions from 0): [R, pos, d_model]."""
        t = tok.shape[1]
        pos = torch.arange(t, device=tok.device)
        if self.shared:
            return F.embedding(tok, self.named["wte"][0]) + self.named["wpe"][0, :t]
        model, groups = self.model, self.groups
        assert groups is not None  # per-position groups whenever the parameters are not shared
        vocab, d = model.wte.shape[1:]
        return (F.embedding(groups[:t] * vocab + tok, model.wte.reshape(-1, d))
                + F.embedding(groups[:t] * model.cfg.n_ctx + pos, model.wpe.reshape(-1, d)))

    def table_rows(self, n_pos: int) -> torch.Tensor | None:
        """Row of each (batch row, position < n_pos) in a table [R·n_pos] (flattened [R, n_pos]): long [batch·n_pos];
        None when the table is the batch itself."""
        if not self.dedupe:
            return None
        if n_pos not in self._rows:
            tok = self.tokens[:, :n_pos]
            self._rows[n_pos] = (tok * n_pos + torch.arange(n_pos, device=tok.device)).reshape(-1)
        return self._rows[n_pos]

    def gather(self, tab: torch.Tensor) -> torch.Tensor:
        """Table values [..., R, P, f] -> batch values [..., batch, P, f]."""
        rows = self.table_rows(tab.shape[-2])
        if rows is None:
            return tab
        lead, (n_tab, n_pos, f) = tab.shape[:-3], tab.shape[-3:]
        flat = tab.reshape(*lead, n_tab * n_pos, f).index_select(len(lead), rows)
        return flat.view(*lead, len(self.tokens), n_pos, f)

    def gather_heads(self, tab: torch.Tensor) -> torch.Tensor:
        """Table q/k/v values [m, R, P, 3d] -> batch values split by head [3, m, batch, head, P, d_head], in one
        gather (no transposing copy of the batch-sized result)."""
        m, n_tab, n_pos, three_d = tab.shape
        heads, dh = self.n_head, three_d // 3 // self.n_head
        split = tab.view(m, n_tab, n_pos, 3, heads, dh).permute(3, 0, 1, 4, 2, 5)  # [3, m, R, H, P, dh]
        if not self.dedupe:
            return split.contiguous()
        flat = split.reshape(3, m, n_tab * heads * n_pos, dh).index_select(2, self._head_rows(n_pos))
        return flat.view(3, m, len(self.tokens), heads, n_pos, dh)

    def _head_rows(self, n_pos: int) -> torch.Tensor:
        """Row (token, head, position) of a table [R·H·n_pos] for each (batch row, head, position): [B·H·n_pos]."""
        key = ("heads", n_pos)
        if key not in self._rows:
            tok = self.tokens[:, :n_pos, None].transpose(1, 2)  # [B, 1, P]
            heads, dev = self.n_head, tok.device
            hp = torch.arange(heads, device=dev)[:, None] * n_pos + torch.arange(n_pos, device=dev)  # [H, P]
            self._rows[key] = (tok * (heads * n_pos) + hp).reshape(-1)
        return self._rows[key]

    def bin_heads(self, *qkv: torch.Tensor) -> torch.Tensor:
        """The adjoint of ``gather_heads``: q, k, v cotangents split by head, each [m, batch, head, P, d_head] ->
        their sums per table row [m, R, P, 3d]."""
        m, bsz, heads, n_pos, dh = qkv[0].shape
        if not self.dedupe:
            return torch.cat([z.transpose(2, 3).reshape(m, bsz, n_pos, heads * dh) for z in qkv], -1)
        rows = self._head_rows(n_pos)
        n_tab = len(self.table_tokens)
        out = qkv[0].new_zeros((3, m, n_tab * heads * n_pos, dh))
        for j, z in enumerate(qkv):
            out[j].index_add_(1, rows, z.reshape(m, bsz * heads * n_pos, dh))
        out = out.view(3, m, n_tab, heads, n_pos, dh).permute(1, 2, 4, 0, 3, 5)  # [m, R, P, 3, H, dh]
        return out.reshape(m, n_tab, n_pos, 3 * heads * dh)

    def bin(self, x: torch.Tensor) -> torch.Tensor:
        """Batch cotangents [m, batch, P, f] -> their sums per table row [m, R, P, f] (the adjoint of ``gather``)."""
        rows = self.table_rows(x.shape[2])
        if rows is None:
            return x
        m, bsz, n_pos, f = x.shape
        out = x.new_zeros((m, len(self.table_tokens) * n_pos, f))
        return out.index_add_(1, rows, x.reshape(m, bsz * n_pos, f)).view(m, -1, n_pos, f)

    def _ln(self, p: _Params, name: str, x: torch.Tensor) -> dict:
        mu = x.mean(-1, keepdim=True)
        sigma = (x - mu).pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()
        n = (x - mu) / sigma
        w, b = p.at(name + "weight", slice(0, x.shape[1])), p.at(name + "bias", slice(0, x.shape[1]))
        return {"n": n, "rsigma": 1 / sigma, "y": n * w + b}

    def _linear(self, p: _Params, name: str, x: torch.Tensor) -> torch.Tensor:
        s = slice(0, x.shape[1])
        if self.shared:
            return F.linear(x, p.at(name + "weight", s), p.at(name + "bias", s))
        return _lin(x, p.at(name + "weight", s), self.shared) + _bias(p.at(name + "bias", s), self.shared, 0)

    def _block(self, p: _Params, pre: str, r: torch.Tensor, r_tab: torch.Tensor | None = None) -> dict:
        """One block's forward and cache; ``r_tab`` [R, t, d]: block 0's input per table row (see the class)."""
        bsz, t, d = r.shape
        c: dict = {"in": r}
        if r_tab is None:
            c["ln1"] = self._ln(p, pre + "ln1.", r)
            qkv = self._linear(p, pre + "attn.c_attn.", c["ln1"]["y"])
        else:  # ln1 and the q/k/v projection once per table row
            c["tab"] = {"ln1": self._ln(p, pre + "ln1.", r_tab)}
            c["ln1"] = {name: self.gather(x) for name, x in c["tab"]["ln1"].items()}
            qkv = self.gather(self._linear(p, pre + "attn.c_attn.", c["tab"]["ln1"]["y"]))
        q, k, v = (z.reshape(bsz, t, self.n_head, -1).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=r.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [batch, head, q, k]
        z = (att @ v).transpose(1, 2).reshape(bsz, t, d)
        mid = r + self._linear(p, pre + "attn.c_proj.", z)
        c.update(q=q, k=k, v=v, att=att, z=z, mid=mid, ln2=self._ln(p, pre + "ln2.", mid))
        a = self._linear(p, pre + "mlp.c_fc.", c["ln2"]["y"])
        c["h"] = F.gelu(a, approximate="tanh")
        # GELU'(a) in one fused kernel: the backward of GELU with an upstream gradient of 1
        c["gelu_slope"] = torch.ops.aten.gelu_backward(a.new_ones(()).expand_as(a), a, approximate="tanh")
        c["out"] = mid + self._linear(p, pre + "mlp.c_proj.", c["h"])
        return c

    def params(self) -> _Params:
        """The model's parameters by name."""
        return _Params(self.named, self.groups, 0)

    def directions(self, flat: torch.Tensor) -> _Params:
        """Flat directions [m, n_params] -> per-parameter views [m, *param.shape], by name."""
        params = list(self.named.values())
        views = flat.split([p.numel() for p in params], dim=1)
        return _Params({n: v.view(len(flat), *p.shape) for n, v, p in zip(self.names, views, params)}, self.groups, 1)


def _ln_tangent(c: dict, dp: _Params, p_w: torch.Tensor, name: str, dx: torch.Tensor, pos: slice) -> torch.Tensor:
    """Tangent of a LayerNorm output: dx [m, batch, P, d] at positions ``pos`` -> [m, batch, P, d]."""
    n, rsigma = c["n"][:, pos], c["rsigma"][:, pos]
    dw, db = dp.at(name + "weight", pos), dp.at(name + "bias", pos)
    if dp.groups is None:
        dw, db = dw[:, None, None], db[:, None, None]
    else:
        dw, db = dw[:, None], db[:, None]
    # ((ẋ − mean ẋ − n·mean(n·ẋ))/σ)·w + n·ẇ + ḃ, in place on one buffer
    y = dx - dx.mean(-1, keepdim=True)
    y.addcmul_(n, (n * dx).mean(-1, keepdim=True), value=-1).mul_(rsigma * p_w)
    return y.addcmul_(n, dw).add_(db)


def site_tangents(primals: Primals, layer: int, pos: "int | torch.Tensor", directions: torch.Tensor) -> torch.Tensor:
    """Tangents of ``resid[layer][:, pos_j]`` along ``directions`` [m, n_params] -> [m, batch, d_model].

    ``pos``: one query position for every direction, or long [m] on the CPU, one per direction (a bucket of sites
    of one layer). Blocks below ``layer − 1`` run over positions ≤ max(pos) (by causality a position's tangent is that of
    its prefix), block ``layer − 1`` for each direction's query alone.
    """
    qpos = torch.as_tensor(pos).expand(len(directions))
    n_pos = int(qpos.max()) + 1  # pos given on the CPU: no device sync
    qpos = qpos.to(directions.device)
    p, dp = primals.params(), primals.directions(directions)
    rows = torch.arange(len(directions), device=directions.device)
    with torch.no_grad():
        dr_tab = _embed_tangent(primals, dp, n_pos - 1)  # per table row
        dr = primals.gather(dr_tab)
        if layer == 0:
            return dr[rows, :, qpos]
        for b in range(layer - 1):
            dr = _block_tangent(primals, p, dp, b, dr, n_pos - 1, dr_tab if b == 0 else None)
        return _top_block_tangent(primals, p, dp, layer - 1, dr, qpos, dr_tab if layer == 1 else None)


def all_tangents(primals: Primals, n_layers: int, n_pos: int, directions: torch.Tensor) -> list[torch.Tensor]:
    """Tangents of ``resid[0..n_layers]`` at positions < n_pos along ``directions`` [m, n_params]: a list of
    [m, batch, n_pos, d_model]. By causality, position i's tangent is the one of the prefix ending at i, so one
    call serves every site (e.g. along the full gradient and the full Adam step)."""
    p, dp = primals.params(), primals.directions(directions)
    with torch.no_grad():
        dr_tab = _embed_tangent(primals, dp, n_pos - 1)
        out = [primals.gather(dr_tab)]
        for b in range(n_layers):
            out.append(_block_tangent(primals, p, dp, b, out[-1], n_pos - 1, dr_tab if b == 0 else None))
    return out


def _embed_tangent(pr: Primals, dp: _Params, pos: int) -> torch.Tensor:
    """ṙ0[r, p] = δwte[g_p, tok[r, p]] + δwpe[g_p, p] per table row r (``Primals.table_tokens``) at positions ≤ pos
    -> [m, R, pos+1, d]."""
    tok = pr.table_tokens[:, :pos + 1]
    positions = torch.arange(pos + 1, device=tok.device)
    g = torch.zeros_like(positions) if pr.groups is None else pr.groups[:pos + 1]
    wte = dp.flat["wte"]  # [m, G, V, d]
    m, n_rows, d = len(wte), wte.shape[1] * wte.shape[2], wte.shape[3]
    rows = (torch.arange(m, device=tok.device)[:, None] * n_rows + (g * wte.shape[2] + tok).reshape(1, -1))
    out = wte.reshape(m * n_rows, d).index_select(0, rows.reshape(-1)).view(m, *tok.shape, d)  # one gather
    return out.add_(dp.flat["wpe"][:, g, positions][:, None])


def _block_tangent(pr: Primals, p: _Params, dp: _Params, b: int, dr: torch.Tensor, pos: int,
                   dr_tab: torch.Tensor | None = None) -> torch.Tensor:
    """Tangent through block b: dr [m, batch, P, d] at positions 0..pos -> [m, batch, P, d]. Block 0 also gets its
    input's tangent per table row, dr_tab [m, R, P, d], and runs ln1 and c_attn on it."""
    c, pre, shared = pr.blocks[b], f"blocks.{b}.", pr.shared
    upto = slice(0, pos + 1)

    def lin(name, x, dx):  # tangent of a linear layer at positions 0..pos: ẋWᵀ + xẆᵀ + ḃ
        if not shared:
            return (_lin(dx, p.at(name + "weight", upto), shared) + _lin(x, dp.at(name + "weight", upto), shared)
                    + _bias(dp.at(name + "bias", upto), shared, 1))
        y = dx @ p.at(name + "weight", upto).T  # [m, B, P, out], accumulated in place (no temporaries)
        dw = dp.at(name + "weight", upto)  # [m, out, in]
        y.view(len(dw), -1, y.shape[-1]).baddbmm_(x.reshape(1, -1, x.shape[-1]).expand(len(dw), -1, -1),
                                                  dw.transpose(1, 2))
        return y.add_(_bias(dp.at(name + "bias", upto), shared, 1))

    ln1 = c["ln1"] if dr_tab is None else c["tab"]["ln1"]
    dx1 = _ln_tangent(ln1, dp, p.at(pre + "ln1.weight", upto), pre + "ln1.", dr if dr_tab is None else dr_tab, upto)
    dqkv = lin(pre + "attn.c_attn.", ln1["y"][:, upto], dx1)
    dz = _attention_tangent(pr, c, dqkv if dr_tab is None else pr.gather_heads(dqkv), upto)
    dmid = lin(pre + "attn.c_proj.", c["z"][:, upto], dz).add_(dr)
    dx2 = _ln_tangent(c["ln2"], dp, p.at(pre + "ln2.weight", upto), pre + "ln2.", dmid, upto)
    dh = lin(pre + "mlp.c_fc.", c["ln2"]["y"][:, upto], dx2).mul_(c["gelu_slope"][:, upto])
    return lin(pre + "mlp.c_proj.", c["h"][:, upto], dh).add_(dmid)


def _rows(t: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """A cached tensor [B, T, ...] at each direction's query position -> [m, B, ...]."""
    return t[:, qpos].transpose(0, 1)


def _top_block_tangent(pr: Primals, p: _Params, dp: _Params, b: int, dr: torch.Tensor, qpos: torch.Tensor,
                       dr_tab: torch.Tensor | None = None):
    """Tangent through block b for each direction's query alone: dr [m, batch, P, d] at positions 0..P−1 ->
    [m, batch, d] at qpos (long [m]); keys and values over positions ≤ the query. Block 0 also gets its input's
    tangent per table row, dr_tab [m, R, P, d] (its ln1 runs on the table)."""
    c, pre = pr.blocks[b], f"blocks.{b}."
    m, n_pos = len(qpos), dr.shape[2]
    rows = torch.arange(m, device=qpos.device)
    g_rows = torch.zeros_like(qpos) if pr.groups is None else pr.groups[qpos]
    upto = slice(0, n_pos)

    def at_rows(params: _Params, name):  # a parameter (or direction) at each row's query group
        t = params.flat[name]
        if params.lead:
            return t[:, 0] if pr.groups is None else t[rows, g_rows]  # [m, *shape] (a view when shared)
        return t[0] if pr.groups is None else t[g_rows]  # [*shape] or [m, *shape]

    def lin(name, x, dx):  # rows: x, dx [m, B, in] -> ẋWᵀ + xẆᵀ + ḃ [m, B, out]
        return (dx @ at_rows(p, name + "weight").transpose(-1, -2) + x @ at_rows(dp, name + "weight").transpose(1, 2)
                + at_rows(dp, name + "bias")[:, None])

    def ln(cache, name, dx):  # rows: LayerNorm tangent [m, B, d]
        n, rsigma = _rows(cache["n"], qpos), _rows(cache["rsigma"], qpos)
        dn = (dx - dx.mean(-1, keepdim=True) - n * (n * dx).mean(-1, keepdim=True)) * rsigma
        w = at_rows(p, name + "weight")
        return dn * (w[:, None] if w.dim() == 2 else w) + n * at_rows(dp, name + "weight")[:, None] + at_rows(
            dp, name + "bias")[:, None]

    dx1_tab = None  # the ln1 tangent per table row, block 0 of a deduplicated table only
    if dr_tab is None:
        dx1 = _ln_tangent(c["ln1"], dp, p.at(pre + "ln1.weight", upto), pre + "ln1.", dr, upto)  # [m, B, P, d]
    else:
        dx1_tab = _ln_tangent(c["tab"]["ln1"], dp, p.at(pre + "ln1.weight", upto), pre + "ln1.", dr_tab, upto)
        dx1 = None if pr.dedupe and pr.shared else pr.gather(dx1_tab)
    x1 = c["ln1"]["y"][:, upto]
    if pr.shared:
        dz = _query_attention_tangent(pr, p, dp, b, x1, dx1, qpos, dx1_tab if dx1 is None else None)
    else:
        name = pre + "attn.c_attn."
        assert dx1 is not None  # None only with shared parameters (above)
        dqkv = (_lin(dx1, p.at(name + "weight", upto), False) + _lin(x1, dp.at(name + "weight", upto), False)
                + _bias(dp.at(name + "bias", upto), False, 1))  # [m, B, P, 3d]
        dz = _query_attention_generic(pr, c, dqkv, qpos)
    dmid = dr[rows, :, qpos] + lin(pre + "attn.c_proj.", _rows(c["z"], qpos), dz)
    dx2 = ln(c["ln2"], pre + "ln2.", dmid)
    dh = lin(pre + "mlp.c_fc.", _rows(c["ln2"]["y"], qpos), dx2) * _rows(c["gelu_slope"], qpos)
    return dmid + lin(pre + "mlp.c_proj.", _rows(c["h"], qpos), dh)


def _query_attention_generic(pr: Primals, c: dict, dqkv: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Attention output tangent at each direction's query alone [m, B, d], from the q/k/v tangents dqkv
    [m, B, P, 3d] at positions 0..P−1 (any parameter groups)."""
    m, bsz, n_pos = dqkv.shape[:3]
    heads, rows = pr.n_head, torch.arange(m, device=qpos.device)
    dq, dk, dv = dqkv.chunk(3, dim=-1)
    dq = dq[rows, :, qpos].view(m, bsz, heads, -1)  # [m, B, H, dh]
    dk, dv = (z.view(m, bsz, n_pos, heads, -1).transpose(2, 3) for z in (dk, dv))  # [m, B, H, P, dh]
    q = c["q"][:, :, qpos].movedim(2, 0)  # [m, B, H, dh]
    k, v = c["k"][:, :, :n_pos], c["v"][:, :, :n_pos]
    att = c["att"][:, :, qpos, :n_pos].movedim(2, 0)  # [m, B, H, P], exactly 0 after the query
    ds = (torch.einsum("mbhe,bhpe->mbhp", dq, k) + torch.einsum("mbhe,mbhpe->mbhp", q, dk)) / math.sqrt(q.shape[-1])
    datt = att * (ds - (att * ds).sum(-1, keepdim=True))
    dz = torch.einsum("mbhp,bhpe->mbhe", datt, v) + torch.einsum("mbhp,mbhpe->mbhe", att, dv)
    return dz.reshape(m, bsz, -1)


def _attention_tangent(pr: Primals, c: dict, dqkv: torch.Tensor, upto: slice) -> torch.Tensor:
    """Attention output tangent [m, batch, P, d] from the q/k/v tangents at positions upto: dqkv [m, batch, P, 3d],
    or already split by head [3, m, batch, head, P, d_head] (``Primals.gather_heads``)."""
    heads = pr.n_head
    if dqkv.dim() == 6:
        dq, dk, dv = dqkv
    else:
        dq, dk, dv = (z.reshape(*z.shape[:3], heads, -1).transpose(2, 3) for z in dqkv.chunk(3, dim=-1))
    m, bsz = dq.shape[:2]
    q, k, v = c["q"][:, :, upto], c["k"][:, :, upto], c["v"][:, :, upto]
    att = c["att"][:, :, upto, upto]  # rows sum to 1 over keys ≤ query (masked entries are exactly 0)
    scale = 1 / math.sqrt(q.shape[-1])
    ds = (dq @ k.transpose(-1, -2) + q @ dk.transpose(-1, -2)) * scale
    datt = att * (ds - (att * ds).sum(-1, keepdim=True))
    dz = datt @ v + att @ dv  # [m, batch, head, Q, d_head]
    return dz.transpose(2, 3).reshape(m, bsz, -1, heads * dz.shape[-1])


def _query_attention_tangent(pr: Primals, p: _Params, dp: _Params, b: int, x1: torch.Tensor, dx1: torch.Tensor | None,
                             qpos: torch.Tensor, dx1_tab: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output tangent at each direction's query alone [m, batch, d], single-group parameters.

    Keys and values enter only through q·k̇ and Σ_t A_t v̇_t, so they regroup per head: with a = W_kᵀq and
    y = Σ_t A_t x1_t, the direction-dependent work is O(m·batch·(d² + head·P·d)) instead of the O(m·batch·P·d²)
    of k̇ and v̇ at every position. x1, dx1: ln1 output [batch, P, d] and its tangent [m, batch, P, d]; qpos [m].
    Block 0 of a deduplicated table (``Primals.dedupe``) gives the tangent per table row instead, dx1_tab
    [m, R, P, d] (dx1 None): the contractions with it run against the table (one batched matmul each, R·P columns)
    and pick each (batch row, position)'s column.
    """
    c, name, heads = pr.blocks[b], f"blocks.{b}.attn.c_attn.", pr.n_head
    d, n_pos = x1.shape[-1], x1.shape[1]
    w, dw = p.at(name + "weight", 0), dp.at(name + "weight", 0)  # [3d, d], [m, 3d, d]
    bias_dot = dp.at(name + "bias", 0)  # [m, 3d]
    m, dh = len(dw), d // heads
    rows = torch.arange(m, device=qpos.device)
    w_k, w_v = w[d:2 * d].view(heads, dh, d), w[2 * d:].view(heads, dh, d)
    dw_k, dw_v = dw[:, d:2 * d].view(m, heads, dh, d), dw[:, 2 * d:].view(m, heads, dh, d)
    q = c["q"][:, :, qpos].movedim(2, 0)  # [m, B, H, dh]
    k, v = c["k"][:, :, :n_pos], c["v"][:, :, :n_pos]  # [B, H, P, dh]
    att = c["att"][:, :, qpos, :n_pos].movedim(2, 0)  # [m, B, H, P], exactly 0 after the query
    x1q = _rows(x1, qpos)  # [m, B, d]
    bsz = len(x1)
    if dx1_tab is None:
        assert dx1 is not None  # one of dx1, dx1_tab is given
        dx1q = dx1[rows, :, qpos]

        # Σ_d a[m, b, h, d] x[(m,) b, t, d] -> [m, B, H, P]
        def dot_a(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("mbhd,mbtd->mbht" if x.dim() == 4 else "mbhd,btd->mbht", a, x)

        # Σ_t att[m, b, h, t] x[(m,) b, t, d] -> [m, B, H, d]
        def dot_att(att: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("mbht,mbtd->mbhd" if x.dim() == 4 else "mbht,btd->mbhd", att, x)

        x1_, dx1_ = x1, dx1
    else:  # x1 and dx1 per table row: [(m,) R·P, d], each (batch row, position) picks its row
        cols = pr.table_rows(n_pos)
        assert cols is not None  # dx1_tab is given only for a deduplicated table
        cols = cols.view(bsz, n_pos)
        x1_ = pr.blocks[b]["tab"]["ln1"]["y"][:, :n_pos].reshape(-1, d)
        dx1_ = dx1_tab.reshape(m, -1, d)
        dx1q = dx1_.gather(1, cols[:, qpos].T[..., None].expand(-1, -1, d))  # [m, B, d]
        at = cols.view(1, bsz, 1, n_pos).expand(m, bsz, heads, n_pos)

        # one matmul against the table's R·P rows, then each (b, t)'s column
        def dot_a(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return (a.reshape(m, -1, d) @ x.transpose(-1, -2)).view(m, bsz, heads, -1).gather(3, at)

        # att spread onto the table's columns (distinct per query row), one matmul
        def dot_att(att: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            spread = att.new_zeros((m, bsz, heads, x.shape[-2])).scatter_(3, at, att)
            return (spread.view(m, -1, x.shape[-2]) @ x).view(m, bsz, heads, d)
    dq = dx1q @ w[:d].T + x1q @ dw[:, :d].transpose(1, 2) + bias_dot[:, None, :d]
    dq = dq.view(m, -1, heads, dh)  # [m, B, H, dh]
    a = torch.einsum("mbhe,hed->mbhd", q, w_k)  # W_kᵀ q per head
    ds = (torch.einsum("mbhe,bhte->mbht", dq, k) + dot_a(a, dx1_)
          + dot_a(torch.einsum("mbhe,mhed->mbhd", q, dw_k), x1_)
          + torch.einsum("mbhe,mhe->mbh", q, bias_dot[:, d:2 * d].view(m, heads, dh))[..., None]) / math.sqrt(dh)
    datt = att * (ds - (att * ds).sum(-1, keepdim=True))
    y = dot_att(att, x1_)  # Σ_t A_t x1_t (rows of A sum to 1)
    dz = (torch.einsum("mbht,bhte->mbhe", datt, v) + torch.einsum("hed,mbhd->mbhe", w_v, dot_att(att, dx1_))
          + torch.einsum("mhed,mbhd->mbhe", dw_v, y) + bias_dot[:, None, 2 * d:].view(m, 1, heads, dh))
    return dz.reshape(m, -1, d)
