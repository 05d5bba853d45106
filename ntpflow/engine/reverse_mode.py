"""Hand-written reverse mode on the cached ordinary forward: site VJPs (∂r^k_i/∂θ)ᵀ c without re-running a forward.

Layer/position convention of ``ntpflow.model.sites``: ``resid[k]`` is the output of block k−1 (``resid[0]`` the
embedding sum); logits at p predict token p+1.

``site_vjps(primals, k, qpos, cot, myopic)`` takes m rows, row r a cotangent ``cot[r]`` [batch, d_model] at
``resid[k][:, qpos[r]]``, and returns the m parameter gradients [m, n_params] (``model.parameters()`` order) of
the model's own regime (``myopic`` ``"none"``, ``"kv"`` or ``"resid"``). Forward values are the same in every
regime, so one ``forward_mode.Primals`` (the ordinary forward) serves all of them; only the backward differs:

- ``"kv"``: query t sees the other positions' keys and values as constants, so only the diagonal s = t of the
  attention carries gradient to k and v;
- ``"resid"``: the other positions' keys and values are re-projected from constant residuals with live weights,
  so the off-diagonal part reaches W_k, W_v and the ln1 affine parameters but not the residual.

Rows of one call may have different query positions (a *bucket* of sites of one layer): every row runs through the
blocks below k−1 over positions 0..P−1 (P = max(qpos) + 1; by causality a row's cotangent is exactly 0 after its
own query, so the padding adds exact zeros) and through block k−1 for its own query alone. In that top block, with
shared (single-group) parameters, the key/value gradients regroup per head (dW_k[h] = Σ_b q_bh ⊗ Σ_s ds_bhs x1_bs,
dW_v[h] = Σ_b dz_bh ⊗ Σ_s A_bhs x1_bs, and the input cotangent through W_kᵀq and W_vᵀdz), so it costs
O(m·batch·(d² + head·P·d)) instead of O(m·batch·P·d²).

Block 0's ln1 and q/k/v projection depend on (token, position) only: with a vocabulary smaller than the batch
(``Primals.dedupe``) their cotangents are summed per (token, position) row of the cache's table (``Primals.bin``,
``bin_heads``, or one matmul against the table in the query-only case) before the weight gradients, ln1's backward
and the embedding's scatter.
"""

import math

import torch

from ntpflow.engine.forward_mode import Primals


class _Grads:
    """Rows of flat parameter gradients out [m, n_params] and, by name, views [m, G, *shape] into them."""

    def __init__(self, pr: Primals, m: int, like: torch.Tensor):
        params = list(pr.named.values())
        self.out = like.new_zeros((m, sum(p.numel() for p in params)))
        views = self.out.split([p.numel() for p in params], dim=1)
        self.view = {n: v.view(m, *p.shape) for n, v, p in zip(pr.names, views, params)}
        self.groups = pr.groups  # None (one group) or [T] group index per position
        self.cfg_groups = pr.model.cfg.groups  # the same, a tuple
        self.rows = torch.arange(m, device=like.device)

    def add_rows(self, view: torch.Tensor, g: torch.Tensor, qpos: torch.Tensor) -> None:
        """Add g [m, *shape] into each row's copy at the group of its query position; view [m, G, *shape]."""
        if self.groups is None:
            view[:, 0] += g
        else:
            view[self.rows, self.groups[qpos]] += g  # one (row, group) pair per row: no duplicates

    def add_positions(self, view: torch.Tensor, n_pos: int, term) -> None:
        """Add ``term(sel)`` [m, *shape], a sum over positions ``sel`` (a slice or an index tensor), into the copy
        of each position group among positions 0..n_pos−1; view [m, G, *shape]."""
        if self.groups is None:
            view[:, 0] += term(slice(0, n_pos))
            return
        for group in sorted(set(self.cfg_groups[:n_pos])):  # from the config: no device sync
            sel = torch.tensor([p for p in range(n_pos) if self.cfg_groups[p] == group], device=self.rows.device)
            view[:, group] += term(sel)


def _outer(dy: torch.Tensor, x: torch.Tensor):
    """Σ over batch and positions ``sel`` of dy ⊗ x: dy [m, B, P, o], x [B, P, i] -> a function of sel, [m, o, i]."""
    def term(sel):
        a, b = dy[:, :, sel], x[:, sel]
        return a.flatten(1, 2).transpose(1, 2) @ b.flatten(0, 1)
    return term


def _summed(y: torch.Tensor, n: torch.Tensor | None = None):
    """Σ over batch and positions ``sel`` of y [m, B, P, d] (times n [B, P, d] if given) -> a function of sel,
    [m, d]."""
    if n is None:
        return lambda sel: y[:, :, sel].sum((1, 2))
    return lambda sel: (y[:, :, sel] * n[:, sel]).sum((1, 2))


def _weight(pr: Primals, name: str, n_pos: int) -> torch.Tensor:
    """A weight at positions 0..n_pos−1: [*shape] (shared) or [n_pos, *shape]."""
    p = pr.named[name]
    return p[0] if pr.groups is None else p.index_select(0, pr.groups[:n_pos])


def _weight_rows(pr: Primals, name: str, qpos: torch.Tensor) -> torch.Tensor:
    """A weight at each row's query position: [*shape] (shared) or [m, *shape]."""
    p = pr.named[name]
    return p[0] if pr.groups is None else p.index_select(0, pr.groups[qpos])


def _matmul_pos(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dy [m, B, P, o] times w [o, i] (shared) or [P, o, i] (per position) -> [m, B, P, i]."""
    return dy @ w if w.dim() == 2 else torch.einsum("mbpo,poi->mbpi", dy, w)


def _matmul_rows(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dy [m, B, o] times w [o, i] (shared) or [m, o, i] (per row) -> [m, B, i]."""
    return dy @ w


def _ln_back(n: torch.Tensor, rsigma: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Input cotangent of a LayerNorm y = n·w + b, n = (x − μ)/σ: dy [..., d] -> [..., d] (n, rsigma, w broadcast)."""
    dn = dy * w
    out = dn - dn.mean(-1, keepdim=True)
    return out.addcmul_(n, (dn * n).mean(-1, keepdim=True), value=-1).mul_(rsigma)


def _gather(x: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at each row's position -> [m, B, ...]."""
    return x[:, qpos].transpose(0, 1)


def _gather_heads(x: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, ...] at each row's query position -> [m, B, H, ...]."""
    return x[:, :, qpos].movedim(2, 0)


def site_vjps(pr: Primals, layer: int, qpos: torch.Tensor, cot: torch.Tensor, myopic: str) -> torch.Tensor:
    """Rows (∂resid[layer][:, qpos[r]]/∂θ)ᵀ cot[r] in the regime ``myopic`` -> [m, n_params].

    qpos: long [m] on the CPU, query positions (< the cached length); cot: [m, batch, d_model].
    """
    m = len(qpos)
    n_pos = int(qpos.max()) + 1  # qpos on the CPU: no device sync
    qpos = qpos.to(cot.device)
    grads = _Grads(pr, m, cot)
    onehot = (torch.arange(n_pos, device=qpos.device) == qpos[:, None]).to(cot.dtype)  # [m, P]
    with torch.no_grad():
        d_tab = None  # the cotangent of resid[0] summed per table row (block 0's ln1 path), see Primals
        if layer == 0:
            d_r = cot.new_zeros((m, cot.shape[1], n_pos, cot.shape[2]))
            d_r.transpose(1, 2)[grads.rows, qpos] = cot  # adjacent indices: vmap places them as without it
        else:
            d_r, d_tab = _top_block_back(pr, grads, layer - 1, qpos, onehot, cot, myopic)
            for b in reversed(range(layer - 1)):
                assert d_r is not None  # None only from block 0, which has no block below it
                d_r, d_tab = _block_back(pr, grads, b, d_r, myopic)
        _embed_back(pr, grads, d_r, d_tab)
    return grads.out


def _embed_back(pr: Primals, grads: _Grads, d_r: torch.Tensor | None, d_tab: torch.Tensor | None) -> None:
    """resid[0][b, p] = wte[g_p, tok[b, p]] + wpe[g_p, p]: scatter d_r [m, B, P, d] (if given) into both, and d_tab
    [m, R, P, d] (per table row, ``Primals.table_tokens``) if given."""
    given = d_r if d_r is not None else d_tab
    assert given is not None  # at least one of the two is given
    m, _, n_pos, d = given.shape
    pos = torch.arange(n_pos, device=given.device)
    g = torch.zeros_like(pos) if pr.groups is None else pr.groups[:n_pos]
    wte, wpe = grads.view["wte"], grads.view["wpe"]  # [m, G, V, d], [m, G, n_ctx, d]
    for cot, tokens in ((d_r, pr.tokens), (d_tab, pr.table_tokens)):
        if cot is None:  # d_r None: everything was summed per table row
            continue
        tok = g * wte.shape[2] + tokens[:, :n_pos]  # [B or R, P]
        wte.view(m, -1, d).index_add_(1, tok.reshape(-1), cot.reshape(m, -1, d))
        wpe.view(m, -1, d).index_add_(1, g * wpe.shape[2] + pos, cot.sum(1))


def _ln_params_rows(grads: _Grads, name: str, n: torch.Tensor, dy: torch.Tensor, qpos: torch.Tensor) -> None:
    """LayerNorm affine gradients at each row's query position: n, dy [m, B, d]."""
    grads.add_rows(grads.view[name + "weight"], (dy * n).sum(1), qpos)
    grads.add_rows(grads.view[name + "bias"], dy.sum(1), qpos)


def _linear_rows(grads: _Grads, name: str, dy: torch.Tensor, x: torch.Tensor, qpos: torch.Tensor) -> None:
    """Weight and bias gradients of a linear layer at each row's query position: dy [m, B, o], x [m, B, i]."""
    grads.add_rows(grads.view[name + "weight"], dy.transpose(1, 2) @ x, qpos)
    grads.add_rows(grads.view[name + "bias"], dy.sum(1), qpos)


def _top_block_back(pr: Primals, grads: _Grads, b: int, qpos: torch.Tensor, onehot: torch.Tensor,
                    d_out: torch.Tensor, myopic: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Block b for each row's query alone: cotangent d_out [m, B, d] at its output at qpos -> the cotangent of its
    input resid[b] at positions 0..P−1 [m, B, P, d] (0 after each row's query) and, for block 0, the part through
    ln1 per table row [m, R, P, d] (else None; see ``Primals``; with a deduplicated table and shared weights all of
    it, the residual path included, is summed per table row and the first is None); parameter gradients into
    grads."""
    m, bsz, d = d_out.shape
    n_pos = onehot.shape[1]
    d_mid, dz = _top_mlp_back(pr, grads, b, qpos, d_out)
    q, dq, (live_k, live_v), (w_k, w_v) = _top_attention_back(pr.blocks[b], qpos, onehot, dz, myopic)
    name = f"blocks.{b}.attn.c_attn."
    dqf = dq.reshape(m, bsz, d)
    grads.add_rows(grads.view[name + "weight"][:, :, :d], dqf.transpose(1, 2) @ _gather(pr.blocks[b]["ln1"]["y"], qpos),
                   qpos)
    grads.add_rows(grads.view[name + "bias"][:, :, :d], dqf.sum(1), qpos)
    dx1_q = _matmul_rows(dqf, _weight_rows(pr, name + "weight", qpos)[..., :d, :])  # [m, B, d], at the query
    table = _QueryTable(pr, qpos, q.shape, n_pos) if b == 0 and pr.dedupe and pr.groups is None else None
    dx1_of = _top_kv_back(pr, grads, b, n_pos, q, dz, w_k, w_v, table)
    rows = grads.rows
    if table is not None:
        add_query = table.add_query
    else:
        def add_query(x, y):  # x [m, B, P, d] += y [m, B, d] at each row's query
            x.transpose(1, 2)[rows, qpos] += y  # adjacent indices: vmap places them as without it
    dx1_live = dx1_of(live_k, live_v)
    add_query(dx1_live, dx1_q)  # the query's own input, through W_q (one position per row)
    if w_k is live_k:
        dx1_all = dx1_live
    else:
        dx1_all = dx1_of(w_k, w_v)
        add_query(dx1_all, dx1_q)
    d_in, d_tab = _ln1_back(pr, grads, b, dx1_all, dx1_live, binned=table is not None)
    if d_tab is None:
        assert d_in is not None  # _ln1_back gives exactly one of the two
        d_in.transpose(1, 2)[rows, qpos] += d_mid  # the residual path at the query
    elif table is not None:
        add_query(d_tab, d_mid)
    else:
        d_in = d_mid.new_zeros(dx1_live.shape)
        d_in.transpose(1, 2)[rows, qpos] += d_mid
    return d_in, d_tab


def _top_mlp_back(pr: Primals, grads: _Grads, b: int, qpos: torch.Tensor,
                  d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block b's MLP, ln2 and attention output projection at each row's query: d_out [m, B, d] -> (the cotangent
    of the residual between attention and MLP, d_mid [m, B, d]; of the heads' outputs, dz [m, B, H, dh]);
    parameter gradients into grads."""
    c, pre = pr.blocks[b], f"blocks.{b}."
    m, bsz, d = d_out.shape
    x2, h = _gather(c["ln2"]["y"], qpos), _gather(c["h"], qpos)
    _linear_rows(grads, pre + "mlp.c_proj.", d_out, h, qpos)
    da = _matmul_rows(d_out, _weight_rows(pr, pre + "mlp.c_proj.weight", qpos)) * _gather(c["gelu_slope"], qpos)
    _linear_rows(grads, pre + "mlp.c_fc.", da, x2, qpos)
    dx2 = _matmul_rows(da, _weight_rows(pr, pre + "mlp.c_fc.weight", qpos))
    n2 = _gather(c["ln2"]["n"], qpos)
    _ln_params_rows(grads, pre + "ln2.", n2, dx2, qpos)
    w2 = _weight_rows(pr, pre + "ln2.weight", qpos)
    d_mid = d_out + _ln_back(n2, _gather(c["ln2"]["rsigma"], qpos), w2[:, None] if w2.dim() == 2 else w2, dx2)
    _linear_rows(grads, pre + "attn.c_proj.", d_mid, _gather(c["z"], qpos), qpos)
    dz = _matmul_rows(d_mid, _weight_rows(pr, pre + "attn.c_proj.weight", qpos)).view(m, bsz, pr.n_head, -1)
    return d_mid, dz


def _top_attention_back(c: dict, qpos: torch.Tensor, onehot: torch.Tensor, dz: torch.Tensor, myopic: str):
    """The attention of each row's query over keys 0..P−1 (block cache ``c``), backwards from dz [m, B, H, dh]:
    (q, dq [m, B, H, dh], (score, pattern) weights [m, B, H, P] of the paths into the residual, the same of the
    paths into the parameters; the two pairs are the same tensors where the regime makes them equal)."""
    n_pos, dh = onehot.shape[1], dz.shape[-1]
    q = _gather_heads(c["q"], qpos)  # [m, B, H, dh]
    k, v = c["k"][:, :, :n_pos], c["v"][:, :, :n_pos]  # [B, H, P, dh]
    att = _gather_heads(c["att"][..., :n_pos], qpos)  # [m, B, H, P], exactly 0 after the query
    datt = torch.einsum("mbhe,bhpe->mbhp", dz, v)
    ds = att * (datt - (att * datt).sum(-1, keepdim=True)) / math.sqrt(dh)  # cotangent of q·k_s (scale included)
    dq = torch.einsum("mbhp,bhpe->mbhe", ds, k)
    diag = onehot[:, None, None, :]
    live = (ds, att) if myopic == "none" else (ds * diag, att * diag)  # paths into the residual
    return q, dq, live, live if myopic == "kv" else (ds, att)  # paths into the weights


class _QueryTable:
    """Block 0's ln1 side summed per row of the deduplicated table (see ``Primals``), for rows of query positions
    qpos [m] over keys 0..P−1 (shape: q's [m, B, H, dh])."""

    def __init__(self, pr: Primals, qpos: torch.Tensor, shape: torch.Size, n_pos: int):
        m, bsz, heads, dh = shape
        cols = pr.table_rows(n_pos)  # the table row of each (batch row, position)
        assert cols is not None  # a _QueryTable is made only for a deduplicated table
        cols = cols.view(bsz, n_pos)
        self.at = cols.view(1, bsz, 1, n_pos).expand(m, bsz, heads, n_pos)
        self.n_tab = len(pr.table_tokens) * n_pos
        self.x1 = pr.blocks[0]["tab"]["ln1"]["y"][:, :n_pos].reshape(self.n_tab, heads * dh)  # [R·P, d]
        self.at_q = cols[:, qpos].T[..., None].expand(-1, -1, heads * dh)  # [m, B, d]: the table row of each query

    def spread(self, w: torch.Tensor) -> torch.Tensor:
        """[m, B, H, P] -> [m, B·H, R·P] on the table's columns (distinct per (b, h))."""
        m, bsz, heads, _ = w.shape
        return w.new_zeros((m, bsz, heads, self.n_tab)).scatter_(3, self.at, w).view(m, bsz * heads, self.n_tab)

    def add_query(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [m, R, P, d] += y [m, B, d] at each row's query, summed per table row."""
        x.view(len(y), -1, y.shape[-1]).scatter_add_(1, self.at_q, y)


def _top_kv_back(pr: Primals, grads: _Grads, b: int, n_pos: int, q: torch.Tensor, dz: torch.Tensor,
                 w_k: torch.Tensor, w_v: torch.Tensor, table: _QueryTable | None):
    """Key and value parameter gradients of block b's attention at each row's query (weights w_k, w_v
    [m, B, H, P] of the paths into the parameters; q, dz [m, B, H, dh]) into grads. Returns ``dx1_of(sk, sv)``:
    the cotangent of ln1's output through the keys and values for weights sk, sv, [m, B, P, d] (with ``table``,
    summed per table row [m, R, P, d])."""
    name = f"blocks.{b}.attn.c_attn."
    m, bsz, heads, dh = q.shape
    d = heads * dh
    x1 = pr.blocks[b]["ln1"]["y"][:, :n_pos]  # [B, P, d]
    w_attn = _weight(pr, name + "weight", n_pos)  # [3d, d] or [P, 3d, d]
    if pr.groups is not None:  # per-position weights: explicit key and value cotangents
        def dkv_of(sk, sv):  # [m, B, P, 2d]
            dk = (sk[..., None] * q[:, :, :, None]).transpose(2, 3).reshape(m, bsz, n_pos, d)
            dv = (sv[..., None] * dz[:, :, :, None]).transpose(2, 3).reshape(m, bsz, n_pos, d)
            return torch.cat([dk, dv], -1)

        dkv = dkv_of(w_k, w_v)
        grads.add_positions(grads.view[name + "weight"][:, :, d:], n_pos, _outer(dkv, x1))
        grads.add_positions(grads.view[name + "bias"][:, :, d:], n_pos, _summed(dkv))
        return lambda sk, sv: _matmul_pos(dkv_of(sk, sv), w_attn[..., d:, :])
    # shared weights: regrouped per head
    wk, wv = w_attn[d:2 * d].view(heads, dh, d), w_attn[2 * d:].view(heads, dh, d)
    if table is not None:  # Σ_p w_p x1_p as one matmul against the table
        uk = (table.spread(w_k) @ table.x1).view(m, bsz, heads, d)
        uv = (table.spread(w_v) @ table.x1).view(m, bsz, heads, d)
    else:
        uk = torch.einsum("mbhp,bpd->mbhd", w_k, x1)
        uv = torch.einsum("mbhp,bpd->mbhd", w_v, x1)
    view_w, view_b = grads.view[name + "weight"][:, 0], grads.view[name + "bias"][:, 0]
    view_w[:, d:2 * d] += torch.einsum("mbhe,mbhd->mhed", q, uk).reshape(m, d, d)
    view_w[:, 2 * d:] += torch.einsum("mbhe,mbhd->mhed", dz, uv).reshape(m, d, d)
    view_b[:, d:2 * d] += torch.einsum("mbhp,mbhe->mhe", w_k, q).reshape(m, d)
    view_b[:, 2 * d:] += torch.einsum("mbhp,mbhe->mhe", w_v, dz).reshape(m, d)
    a, e = torch.einsum("mbhe,hed->mbhd", q, wk), torch.einsum("mbhe,hed->mbhd", dz, wv)  # W_kᵀq, W_vᵀdz

    def dx1_of(sk, sv):  # through the keys and values at positions 0..P−1
        if table is not None:  # summed per table row [m, R, P, d]: one matmul over (batch, head)
            s_kv = torch.cat([table.spread(sk), table.spread(sv)], 1).transpose(1, 2)  # [m, R·P, 2·B·H]
            return (s_kv @ torch.cat([a, e], 1).view(m, 2 * bsz * heads, d)).view(m, -1, n_pos, d)
        return torch.einsum("mbhp,mbhd->mbpd", sk, a) + torch.einsum("mbhp,mbhd->mbpd", sv, e)
    return dx1_of


def _ln1_back(pr: Primals, grads: _Grads, b: int, dx1_all: torch.Tensor, dx1_live: torch.Tensor,
              binned: bool = False):
    """Block b's ln1: its output cotangents [m, B, P, d] (all paths, for its parameters; the live paths, into the
    residual) -> (input cotangent [m, B, P, d], None), or for block 0 (None, the input cotangent per table row
    [m, R, P, d]) with the sums regrouped per table row (``binned``: the given cotangents already are, [m, R, P, d]);
    parameter gradients into grads."""
    c, pre = pr.blocks[b], f"blocks.{b}."
    n_pos = dx1_all.shape[2]
    cache = c["ln1"]
    if b == 0:
        cache = c["tab"]["ln1"]
        if not binned:
            same = dx1_all is dx1_live
            dx1_live = pr.bin(dx1_live)
            dx1_all = dx1_live if same else pr.bin(dx1_all)
    n1, rs1 = cache["n"][:, :n_pos], cache["rsigma"][:, :n_pos]
    grads.add_positions(grads.view[pre + "ln1.weight"], n_pos, _summed(dx1_all, n1))
    grads.add_positions(grads.view[pre + "ln1.bias"], n_pos, _summed(dx1_all))
    d_in = _ln_back(n1, rs1, _weight(pr, pre + "ln1.weight", n_pos), dx1_live)
    return (None, d_in) if b == 0 else (d_in, None)


def _linear_pos(grads: _Grads, name: str, dy: torch.Tensor, x: torch.Tensor, n_pos: int) -> None:
    """Weight and bias gradients of a linear layer over positions 0..n_pos−1: dy [m, B, P, o], x [B, P, i]."""
    grads.add_positions(grads.view[name + "weight"], n_pos, _outer(dy, x))
    grads.add_positions(grads.view[name + "bias"], n_pos, _summed(dy))


def _block_back(pr: Primals, grads: _Grads, b: int, d_out: torch.Tensor,
                myopic: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block b over positions 0..P−1: cotangent d_out [m, B, P, d] of its output -> that of its input [m, B, P, d]
    and, for block 0, the part through ln1 per table row [m, R, P, d] (else None; see ``Primals``: block 0's c_attn
    and ln1 run on the table); parameter gradients into grads."""
    c, pre = pr.blocks[b], f"blocks.{b}."
    m, bsz, n_pos, d = d_out.shape
    heads = pr.n_head
    dh = d // heads
    upto = slice(0, n_pos)
    _linear_pos(grads, pre + "mlp.c_proj.", d_out, c["h"][:, upto], n_pos)
    da = _matmul_pos(d_out, _weight(pr, pre + "mlp.c_proj.weight", n_pos)).mul_(c["gelu_slope"][:, upto])
    _linear_pos(grads, pre + "mlp.c_fc.", da, c["ln2"]["y"][:, upto], n_pos)
    dx2 = _matmul_pos(da, _weight(pr, pre + "mlp.c_fc.weight", n_pos))
    n2 = c["ln2"]["n"][:, upto]
    grads.add_positions(grads.view[pre + "ln2.weight"], n_pos, _summed(dx2, n2))
    grads.add_positions(grads.view[pre + "ln2.bias"], n_pos, _summed(dx2))
    d_mid = d_out + _ln_back(n2, c["ln2"]["rsigma"][:, upto], _weight(pr, pre + "ln2.weight", n_pos), dx2)
    _linear_pos(grads, pre + "attn.c_proj.", d_mid, c["z"][:, upto], n_pos)
    dz = _matmul_pos(d_mid, _weight(pr, pre + "attn.c_proj.weight", n_pos))
    dz = dz.view(m, bsz, n_pos, heads, dh).transpose(2, 3)  # [m, B, H, P, dh]
    q, k, v = c["q"][:, :, upto], c["k"][:, :, upto], c["v"][:, :, upto]
    att = c["att"][:, :, upto, upto]  # [B, H, P(query), P(key)]
    datt = dz @ v.transpose(-1, -2)
    ds = att * (datt - (att * datt).sum(-1, keepdim=True)) / math.sqrt(dh)
    dq = ds @ k
    eye = torch.eye(n_pos, dtype=ds.dtype, device=ds.device)
    live_s, live_a = (ds, att) if myopic == "none" else (ds * eye, att * eye)
    w_s, w_a = (live_s, live_a) if myopic == "kv" else (ds, att)

    def dqkv_of(s, a):  # [m, B, P, 3d] with keys from s, values from a; block 0: per table row [m, R, P, 3d]
        dk, dv = s.transpose(-1, -2) @ q, a.transpose(-1, -2) @ dz
        if b == 0:
            return pr.bin_heads(dq, dk, dv)
        return torch.cat([z.transpose(2, 3).reshape(m, bsz, n_pos, d) for z in (dq, dk, dv)], -1)

    name = pre + "attn.c_attn."
    w_attn = _weight(pr, name + "weight", n_pos)
    x1 = (c["tab"] if b == 0 else c)["ln1"]["y"][:, upto]
    dqkv = dqkv_of(w_s, w_a)
    _linear_pos(grads, name, dqkv, x1, n_pos)
    dx1_all = _matmul_pos(dqkv, w_attn)
    dx1_live = dx1_all if w_s is live_s else _matmul_pos(dqkv_of(live_s, live_a), w_attn)
    d_in, d_tab = _ln1_back(pr, grads, b, dx1_all, dx1_live, binned=True)
    if b == 0:
        return d_mid, d_tab
    assert d_in is not None  # _ln1_back gives the input cotangent of every block but block 0
    return d_mid + d_in, None


def own_cotangents(pr: Primals, layer: int, qpos: torch.Tensor, d_logits: torch.Tensor) -> torch.Tensor:
    """Own-position cotangents ∂L_i/∂resid[layer][:, i] [m, batch, d_model] in the ordinary regime, i = qpos[r].

    qpos: long [m] on the CPU; d_logits [m, batch, vocab]: ∂L/∂logits at each row's position (the ordinary
    backward's). By causality the
    residuals at positions < i do not depend on r^k_i, so only position i is live: the final LayerNorm and tied
    unembedding at i, then blocks n_layer−1 … layer for query i alone, whose keys and values are live at i only.
    """
    model = pr.model
    n_pos = int(qpos.max()) + 1  # qpos on the CPU: no device sync
    qpos = qpos.to(d_logits.device)
    with torch.no_grad():
        x = _gather(pr.resid[-1], qpos)  # [m, B, d]
        mu = x.mean(-1, keepdim=True)
        rsigma = 1 / (x - mu).pow(2).mean(-1, keepdim=True).add(pr.eps).sqrt()
        d_y = _matmul_rows(d_logits, _weight_rows(pr, "wte", qpos))
        d_r = _ln_back((x - mu) * rsigma, rsigma, _unsqueeze_rows(_weight_rows(pr, "ln_final.weight", qpos)), d_y)
        for b in reversed(range(layer, model.cfg.n_layer)):
            d_r = _own_block_back(pr, b, qpos, n_pos, d_r)
    return d_r


def _unsqueeze_rows(w: torch.Tensor) -> torch.Tensor:
    """A LayerNorm weight [d] (shared) or [m, d] (per row) shaped to broadcast against [m, B, d]."""
    return w[:, None] if w.dim() == 2 else w


def _own_block_back(pr: Primals, b: int, qpos: torch.Tensor, n_pos: int, d_out: torch.Tensor) -> torch.Tensor:
    """Input cotangent of block b at each row's query alone, with only that position live (its own key and value):
    d_out [m, B, d] at the block's output -> [m, B, d] at its input, both at qpos; n_pos = max(qpos) + 1."""
    c, pre = pr.blocks[b], f"blocks.{b}."
    m, bsz, d = d_out.shape
    heads = pr.n_head
    dh = d // heads
    da = _matmul_rows(d_out, _weight_rows(pr, pre + "mlp.c_proj.weight", qpos)) * _gather(c["gelu_slope"], qpos)
    dx2 = _matmul_rows(da, _weight_rows(pr, pre + "mlp.c_fc.weight", qpos))
    w2 = _unsqueeze_rows(_weight_rows(pr, pre + "ln2.weight", qpos))
    d_mid = d_out + _ln_back(_gather(c["ln2"]["n"], qpos), _gather(c["ln2"]["rsigma"], qpos), w2, dx2)
    dz = _matmul_rows(d_mid, _weight_rows(pr, pre + "attn.c_proj.weight", qpos)).view(m, bsz, heads, dh)
    q = _gather_heads(c["q"], qpos)  # [m, B, H, dh]
    k, v = c["k"][:, :, :n_pos], c["v"][:, :, :n_pos]
    att = _gather_heads(c["att"][..., :n_pos], qpos)  # [m, B, H, P]
    datt = torch.einsum("mbhe,bhpe->mbhp", dz, v)
    ds = att * (datt - (att * datt).sum(-1, keepdim=True)) / math.sqrt(dh)
    diag = (torch.arange(n_pos, device=qpos.device) == qpos[:, None]).to(ds.dtype)[:, None, None, :]  # [m,1,1,P]
    dq = torch.einsum("mbhp,bhpe->mbhe", ds, k)
    dk = (ds * diag).sum(-1, keepdim=True) * q  # the query's own key and value
    dv = (att * diag).sum(-1, keepdim=True) * dz
    dqkv = torch.cat([z.reshape(m, bsz, d) for z in (dq, dk, dv)], -1)  # [m, B, 3d]
    dx1 = _matmul_rows(dqkv, _weight_rows(pr, pre + "attn.c_attn.weight", qpos))
    w1 = _unsqueeze_rows(_weight_rows(pr, pre + "ln1.weight", qpos))
    return d_mid + _ln_back(_gather(c["ln1"]["n"], qpos), _gather(c["ln1"]["rsigma"], qpos), w1, dx1)
