"""Gradient decomposition and influence against a naive float64 oracle of the definitions."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from ntpflow import GPT, GPTConfig, Site, TrainConfig, lm_loss, per_position_loss, split_groups, train
from ntpflow.engine.decomposition import decompose, flat_grads
from ntpflow.engine.forward_mode import Primals, all_tangents, site_tangents
from ntpflow.engine.influence import MISMATCHES, InfluenceTracker, Probe
from ntpflow.engine.reverse_mode import site_vjps

T, V, D = 8, 7, 16
REGIMES = [{}, {"myopic": "kv"}, {"myopic": "resid"}, {"position_groups": "untied"},
           {"position_groups": split_groups(T, 3)}, {"position_groups": split_groups(T, 3), "myopic": "kv"}]


def tiny(seed=0, **kw) -> GPT:
    return GPT(GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D, **kw), seed=seed).double()


def batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, T), generator=g)
    mask = torch.rand(n, T, generator=g) > 0.2
    return tokens, mask


def oracle(model, tokens, site, mask):
    """The definition: stop-gradient forward and separate backward passes per loss term."""
    params = list(model.parameters())

    def grad(f):
        return flat_grads(torch.autograd.grad(f, params, allow_unused=True, retain_graph=True), params)

    per_pos, counted = per_position_loss(model(tokens), tokens, mask)
    per_pos_sg, _ = per_position_loss(model(tokens, stop_grad_at=[site]), tokens, mask)
    n = counted.sum()
    full, shared = grad(per_pos.sum() / n), grad(per_pos_sg.sum() / n)
    i = site.pos
    direct = grad(per_pos[i] / n) - grad(per_pos_sg[i] / n) if i < len(per_pos) else torch.zeros_like(full)
    pre = sum((grad(per_pos[j] / n) - grad(per_pos_sg[j] / n) for j in range(len(per_pos)) if j != i),
              torch.zeros_like(full))
    return {"direct": direct, "pre_cached": pre, "shared": shared, "full": full}


@pytest.mark.parametrize("kw", REGIMES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "vanilla")
def test_decompose_matches_oracle(kw):
    model = tiny(**kw)
    tokens, mask = batch()
    sites = [Site(k, p) for k in range(3) for p in (0, 2, 5, T - 1)]
    parts = decompose(model, tokens, sites, mask)
    for s in sites:
        ref = oracle(model, tokens, s, mask)
        scale = ref["full"].abs().max()
        for name, value in parts[s].as_dict().items():
            err = (value - ref[name]).abs().max() / scale
            assert err < 1e-10, (s, name, err.item())
        total = parts[s].direct + parts[s].pre_cached + parts[s].shared
        torch.testing.assert_close(total, ref["full"], rtol=0, atol=1e-12)
        if kw.get("myopic") or s.layer == 2:
            assert parts[s].pre_cached.abs().max() == 0  # exact: no later position reads r_i here: set to 0, not computed
    if not kw.get("myopic"):
        assert any(parts[s].pre_cached.abs().max() > 1e-6 for s in sites if s.layer < 2)


def assert_one_bucket_per_layer_matches_oracle(model, tokens, mask):
    """decompose with every site of a layer in one bucket (positions T−1, 0, 4, 2 of layers 0–2 mixed, padded to
    the longest prefix) against the float64 oracle of the definition."""
    sites = [Site(k, p) for k in range(3) for p in (T - 1, 0, 4, 2)]
    parts = decompose(model, tokens, sites, mask, bucket_width=T)
    for s in sites:
        ref = oracle(model, tokens, s, mask)
        for name, value in parts[s].as_dict().items():
            assert (value - ref[name]).abs().max() < 1e-10 * ref["full"].abs().max(), (s, name)


@pytest.mark.parametrize("kw", REGIMES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "vanilla")
def test_decompose_one_bucket_per_layer_matches_oracle(kw):
    """All sites of a layer in one reverse-mode call (positions 0..T−1 mixed, padded to the longest prefix)."""
    model = tiny(**kw)
    tokens, mask = batch()
    assert_one_bucket_per_layer_matches_oracle(model, tokens, mask)


@pytest.mark.parametrize("kw", [{}, {"myopic": "resid"}, {"position_groups": "untied"},
                                {"position_groups": split_groups(T, 3)}],
                         ids=["vanilla", "myopic=resid", "untied", "split"])
def test_forward_mode_tangents_match_vjps(kw):
    """⟨u, J δ⟩ from the hand-written forward mode equals ⟨Jᵀu, δ⟩ from autograd, J = ∂r^k_i/∂θ of the ordinary
    (non-myopic) forward, for every site (layers 0..2, first and last positions) and both entry points."""
    model = tiny(**kw)
    tokens, _ = batch()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(5)
    directions = torch.randn(3, n_params, generator=g, dtype=torch.float64)
    _, r = model(tokens, return_resid=True, myopic="none")
    primals = Primals(model, tokens)
    for a, b in zip(primals.resid, r):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    every = all_tangents(primals, 2, T, directions)
    for site in [Site(k, p) for k in range(3) for p in (0, 3, T - 1)]:
        u = torch.randn(len(tokens), D, generator=g, dtype=torch.float64)
        ref = directions @ flat_grads(torch.autograd.grad(r[site.layer][:, site.pos], params, u, retain_graph=True,
                                                          allow_unused=True), params)
        for tangents in (site_tangents(primals, site.layer, site.pos, directions),
                         every[site.layer][:, :, site.pos]):
            got = (tangents * u).sum((1, 2))
            assert (got - ref).abs().max() <= 1e-12 * ref.abs().max(), site
    # a forward that stops at the sites' highest layer: the same numbers, bit for bit
    for top in (0, 1):
        short = Primals(model, tokens, top)
        assert len(short.resid) == top + 1 and len(short.blocks) == top
        assert all(torch.equal(a, b) for a, b in zip(short.resid, primals.resid))
        assert torch.equal(site_tangents(short, top, T - 1, directions), site_tangents(primals, top, T - 1, directions))


@pytest.mark.parametrize("kw", REGIMES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "vanilla")
def test_bucketed_reverse_and_forward_mode_match_autograd(kw):
    """One call for sites of one layer at different positions (a bucket padded to its longest prefix): every row of
    the reverse mode equals autograd's (∂r^k_i/∂θ)ᵀu in the model's regime, and every row of the forward mode equals
    J·δ of the ordinary forward, site by site; rows in any order, positions repeated."""
    model = tiny(**kw)
    tokens, _ = batch()
    g = torch.Generator().manual_seed(7)
    directions = torch.randn(6, sum(p.numel() for p in model.parameters()), generator=g, dtype=torch.float64)
    assert_site_modes_match_autograd(model, tokens, Primals(model, tokens[:, :T - 1]), directions, g)


def assert_site_modes_match_autograd(model, tokens, primals, directions, g, every=None):
    """For layers 0..2 and a bucket of 6 mixed, repeated positions: each row of ``site_vjps`` equals autograd's
    (∂r^k_i/∂θ)ᵀu in the model's regime, and each row of ``site_tangents`` (and of the all-sites tangents ``every``,
    [layer][row, batch, pos, d], where given) equals J·δ of the ordinary forward, u random."""
    params = list(model.parameters())
    pos = torch.tensor([5, 0, 2, 6, 2, 3])
    for layer in range(3):
        u = torch.randn(len(pos), len(tokens), D, generator=g, dtype=torch.float64)
        vjps = site_vjps(primals, layer, pos, u, model.myopic)
        tangents = site_tangents(primals, layer, pos, directions)
        for j, i in enumerate(pos.tolist()):
            r = model.resid_last(tokens[:, :i + 1], layer)
            ref = flat_grads(torch.autograd.grad(r, params, u[j], allow_unused=True), params)
            assert (vjps[j] - ref).abs().max() <= 1e-12 * ref.abs().max(), (layer, i)
            r = model.resid_last(tokens[:, :i + 1], layer, myopic="none")
            ref = flat_grads(torch.autograd.grad(r, params, u[j], allow_unused=True), params) @ directions[j]
            for got in (tangents[j], *([] if every is None else [every[layer][j, :, i]])):
                assert abs((got * u[j]).sum() - ref) <= 1e-12 * abs(ref), (layer, i)


@pytest.mark.parametrize("kw", REGIMES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "vanilla")
def test_embedding_table_matches_autograd_and_oracle(kw):
    """A batch larger than the vocabulary: block 0's ln1 and c_attn run once per (token, position) of the cache's
    table (``Primals.dedupe``). The cached forward, every row of the reverse and forward modes (buckets of mixed
    positions, layers 0..2, and the all-sites tangents) and the decomposition (one bucket per layer) still equal
    autograd and the oracle."""
    model = tiny(**kw)
    tokens, mask = batch(seed=3, n=3 * V)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(8)
    primals = Primals(model, tokens[:, :T - 1])
    assert primals.dedupe
    _, r = model(tokens[:, :T - 1], return_resid=True, myopic="none")
    for a, b in zip(primals.resid, r):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    directions = torch.randn(6, n_params, generator=g, dtype=torch.float64)
    every = all_tangents(primals, 2, T - 1, directions)
    assert_site_modes_match_autograd(model, tokens, primals, directions, g, every)
    assert_one_bucket_per_layer_matches_oracle(model, tokens, mask)


def test_decompose_leaves_state_untouched():
    model = tiny()
    tokens, mask = batch()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    rng = torch.get_rng_state()
    before = [p.detach().clone() for p in model.parameters()]
    decompose(model, tokens, [Site(1, 3)], mask)
    assert torch.equal(torch.get_rng_state(), rng)  # exact: RNG state bytes: decompose draws no random numbers
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and torch.all(p.grad == 0.5)  # exact: decompose must not touch weights or .grad (copies compared)


def _risk_grad(model, final, probe, tokens, mismatch="paper"):
    """∇θ R by plain autograd on R = mean_b d_b² (paper) or R_c = mean_b d_b² − (mean_b d_b)² (centred), with
    d_b = ⟨w, r_b⟩ − ⟨w, r*_b⟩ from the non-myopic forward."""
    k, i = probe.site.layer, probe.site.pos
    _, r = model(tokens, return_resid=True, myopic="none")
    with torch.no_grad():
        _, r_star = final(tokens, return_resid=True, myopic="none")
    d = (r[k][:, i] - r_star[k][:, i]) @ probe.w
    risk = d.pow(2).mean() if mismatch == "paper" else d.pow(2).mean() - d.mean().pow(2)
    params = list(model.parameters())
    return flat_grads(torch.autograd.grad(risk, params, allow_unused=True), params)


@pytest.mark.parametrize("sgd_rows", [True, False], ids=["all-rows", "adam-only"])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("kw", [{}, {"myopic": "kv"}, {"position_groups": split_groups(T, 3)}])
def test_influence_of_full_step_is_real_step(opt_name, kw, sgd_rows):
    """Adam/SGD: the components' steps add up to the optimizer's real update, seen through ∇R."""
    model, final = tiny(seed=0, **kw), tiny(seed=1, **kw)
    g = torch.Generator().manual_seed(3)
    probes = [Probe(Site(1, 3), "a", torch.randn(D, generator=g, dtype=torch.float64)),
              Probe(Site(2, 5), "b", torch.randn(D, generator=g, dtype=torch.float64))]
    tracker = InfluenceTracker(final, probes, sgd_rows=sgd_rows)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if opt_name == "adam"
           else torch.optim.SGD(model.parameters(), lr=1e-1))
    for step in range(3):
        tokens, mask = batch(seed=step)
        grads_r = {(p.name, m): _risk_grad(model, final, p, tokens, m) for p in probes for m in MISMATCHES}
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        opt_state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()} if step else {}
        rows = tracker.track(model, opt, tokens, mask)
        expected_optimizers = {"none"} | ({"sgd"} if opt_name == "sgd" or sgd_rows else set()) | (
            {"adam"} if opt_name == "adam" else set())
        assert {r["optimizer"] for r in rows} == expected_optimizers
        if step:  # tracking leaves the optimizer state alone
            for k, v in opt.state[next(model.parameters())].items():
                assert torch.equal(v, opt_state[k])  # exact: track() must not write the optimizer state (a copy compared)
        loss = lm_loss(model(tokens), tokens, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        real = before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # subtracted step
        for p, m in ((p, m) for p in probes for m in MISMATCHES):
            vals = {r["component"]: r["value"] for r in rows if r["feature"] == p.name and r["mismatch"] == m
                    and r["optimizer"] == opt_name and r["feature_type"] == -1}
            expected = torch.dot(grads_r[p.name, m], real).item()
            assert vals["full"] == pytest.approx(expected, rel=1e-8, abs=1e-14)
            assert vals["direct"] + vals["pre_cached"] + vals["shared"] == pytest.approx(vals["full"], rel=1e-9,
                                                                                         abs=1e-15)


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("kw", [{}, {"myopic": "kv"}, {"position_groups": split_groups(T, 3)}])
def test_midpoint_influence_reads_the_gradient_halfway_along_the_real_step(opt_name, kw):
    """midpoint=True: full influence = ∇R(θ − Δ/2)·Δ with Δ the real (subtracted) step; the SGD components are
    lr·∇R(θ − Δ/2)·g_c with g_c the oracle's components at θ; risk rows stay R(θ)."""
    model, final = tiny(seed=0, **kw), tiny(seed=1, **kw)
    g = torch.Generator().manual_seed(3)
    probes = [Probe(Site(1, 3), "a", torch.randn(D, generator=g, dtype=torch.float64)),
              Probe(Site(2, 5), "b", torch.randn(D, generator=g, dtype=torch.float64))]
    tracker = InfluenceTracker(final, probes, midpoint=True)
    lr = 1e-2 if opt_name == "adam" else 1e-1
    opt = (torch.optim.Adam(model.parameters(), lr=lr) if opt_name == "adam"
           else torch.optim.SGD(model.parameters(), lr=lr))
    middle = tiny(seed=0, **kw)
    for step in range(3):
        tokens, mask = batch(seed=step)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        ref = oracle(model, tokens, probes[0].site, mask)
        rows = tracker.track(model, opt, tokens, mask)
        risks = {(r["feature"], r["mismatch"]): r["value"] for r in rows if r["component"] == "risk"
                 and r["feature_type"] == -1}
        tracker.optimizer_step(model, opt)
        real = before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # subtracted step
        with torch.no_grad():
            for q, b in zip(middle.parameters(), (before - real / 2).split([q.numel() for q in middle.parameters()])):
                q.copy_(b.view_as(q))
        for p, m in ((p, m) for p in probes for m in MISMATCHES):
            vals = {(r["optimizer"], r["component"]): r["value"] for r in rows if r["feature"] == p.name
                    and r["mismatch"] == m and r["feature_type"] == -1}
            g_mid = _risk_grad(middle, final, p, tokens, m)
            assert vals[opt_name, "full"] == pytest.approx(torch.dot(g_mid, real).item(), rel=1e-8, abs=1e-14)
            if p.name == "a":  # the oracle's components are of site ⟨1, 3⟩
                for c in ("direct", "pre_cached", "shared"):
                    assert vals["sgd", c] == pytest.approx(lr * torch.dot(g_mid, ref[c]).item(), rel=1e-8, abs=1e-14)
            d = (probe_resid(before, model, tokens, p) - probe_resid(None, final, tokens, p))
            r_at_theta = d.pow(2).mean() if m == "paper" else d.var(unbiased=False)
            assert risks[p.name, m] == pytest.approx(r_at_theta.item(), rel=1e-10)


def probe_resid(flat, model, tokens, probe):
    """⟨w, r^k_i⟩ [batch] of ``model`` with its weights set to ``flat`` (None: as they are)."""
    if flat is not None:
        model = __import__("copy").deepcopy(model)
        with torch.no_grad():
            for q, b in zip(model.parameters(), flat.split([q.numel() for q in model.parameters()])):
                q.copy_(b.view_as(q))
    _, r = model(tokens, return_resid=True, myopic="none")
    return r[probe.site.layer][:, probe.site.pos].detach() @ probe.w


@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_sgd_influence_matches_oracle_components(mismatch):
    model, final = tiny(seed=0), tiny(seed=1)
    w = torch.randn(D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probe = Probe(Site(1, 4), "f", w)
    tokens, mask = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = InfluenceTracker(final, [probe])
    rows = tracker.track(model, opt, tokens, mask)
    ref = oracle(model, tokens, probe.site, mask)
    g_r = _risk_grad(model, final, probe, tokens, mismatch)
    for r in rows:
        if r["optimizer"] == "sgd" and r["mismatch"] == mismatch:
            assert r["value"] == pytest.approx(0.1 * torch.dot(g_r, ref[r["component"]]).item(), rel=1e-8, abs=1e-15)


@pytest.mark.parametrize("kw", [{}, {"myopic": "resid"}, {"position_groups": "untied"}],
                         ids=["vanilla", "myopic=resid", "untied"])
def test_tracker_with_embedding_table_matches_oracle_components(kw):
    """A batch larger than the vocabulary (the cache's deduplicated table): every SGD component at sites in layers
    0, 1 and 2 equals lr·⟨∇R, oracle component⟩ for both mismatches, whole batch and per feature type."""
    model, final = tiny(seed=0, **kw), tiny(seed=1, **kw)
    g = torch.Generator().manual_seed(9)
    sites = [Site(0, 3), Site(1, 2), Site(1, 6), Site(2, 5)]
    probes = [Probe(s, f"f{j}", torch.randn(D, generator=g, dtype=torch.float64)) for j, s in enumerate(sites)]
    tokens, mask = batch(seed=4, n=3 * V)
    types = {p.name: torch.randint(0, 2, tokens.shape, generator=g) for p in probes[:2]}
    tracker = InfluenceTracker(final, probes)
    rows = tracker.track(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens, mask, feature_types=types)
    for p in probes:
        ref = oracle(model, tokens, p.site, mask)
        for mismatch in MISMATCHES:
            g_r = _risk_grad(model, final, p, tokens, mismatch)
            mine = [r for r in rows if r["feature"] == p.name and r["optimizer"] == "sgd" and r["mismatch"] == mismatch
                    and r["feature_type"] == -1]
            assert len(mine) == 4
            for r in mine:
                expected = 0.1 * torch.dot(g_r, ref[r["component"]]).item()
                assert r["value"] == pytest.approx(expected, rel=1e-8, abs=1e-15), (p.site, r["component"])
    assert {r["feature_type"] for r in rows if r["feature"] == "f0"} == {-1, 0, 1}

@pytest.mark.parametrize("kw", [{}, {"myopic": "kv"}, {"position_groups": split_groups(T, 3)}],
                         ids=["vanilla", "myopic=kv", "split"])
def test_bucketed_tracker_matches_oracle_components(kw):
    """Sites of one layer at different positions tracked in one bucket (and in buckets split by the memory cap):
    every SGD component equals lr·⟨∇R, oracle component⟩ site by site; the Adam rows of two steps equal those of
    one site per bucket."""
    model, final = tiny(seed=0, **kw), tiny(seed=1, **kw)
    g = torch.Generator().manual_seed(4)
    sites = [Site(0, 2), Site(1, 1), Site(1, 4), Site(1, 6), Site(2, 3), Site(2, 6), Site(2, 0)]
    probes = [Probe(s, f"f{j}", torch.randn(D, generator=g, dtype=torch.float64)) for j, s in enumerate(sites)]
    tokens, mask = batch()
    wide = InfluenceTracker(final, probes, bucket_width=8)
    assert [len(wide.sites[b]) for b in wide.buckets(len(tokens), tokens.device)] == [1, 3, 3]
    narrow = InfluenceTracker(final, probes, bucket_width=3)
    assert [len(narrow.sites[b]) for b in narrow.buckets(len(tokens), tokens.device)] == [1, 1, 2, 1, 1, 1]
    capped = InfluenceTracker(final, probes, bucket_width=8, bucket_elements=4 * 2 * len(tokens) * 7 * D)
    assert [len(capped.sites[b]) for b in capped.buckets(len(tokens), tokens.device)] == [1, 2, 1, 2, 1]
    for tracker in (wide, capped):
        rows = tracker.track(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens, mask)
        for p in probes:
            ref = oracle(model, tokens, p.site, mask)
            for mismatch in MISMATCHES:
                g_r = _risk_grad(model, final, p, tokens, mismatch)
                for r in rows:
                    if r["feature"] == p.name and r["optimizer"] == "sgd" and r["mismatch"] == mismatch:
                        expected = 0.1 * torch.dot(g_r, ref[r["component"]]).item()
                        assert r["value"] == pytest.approx(expected, rel=1e-8, abs=1e-15), (p.site, r["component"])
    trackers = [InfluenceTracker(final, probes, bucket_width=w) for w in (1, 8)]
    models = [tiny(seed=0, **kw) for _ in trackers]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    for step in range(2):
        tokens, mask = batch(seed=step)
        rows = []
        for tracker, m, opt in zip(trackers, models, opts):
            rows.append(tracker.track(m, opt, tokens, mask))
            opt.zero_grad()
            lm_loss(m(tokens), tokens, mask).backward()
            opt.step()
        assert [r["component"] for r in rows[0]] == [r["component"] for r in rows[1]]
        for a, b in zip(*rows):
            assert b["value"] == pytest.approx(a["value"], rel=1e-9, abs=1e-15), a


def test_cached_final_projections_equal_per_step_forward():
    """With the replay's dataset registered, θ*'s projections come from a per-example cache filled a chunk at a time
    on demand; the rows equal those of a θ* forward on the batch."""
    model, final = tiny(seed=0), tiny(seed=1)
    g = torch.Generator().manual_seed(2)
    probes = [Probe(s, f"f{j}", torch.randn(D, generator=g, dtype=torch.float64))
              for j, s in enumerate([Site(1, 3), Site(2, 5)])]
    data, _ = batch(seed=9, n=20)
    ids = torch.tensor([9, 1, 5, 3])
    mask = torch.rand(len(ids), T, generator=g) > 0.2
    cached, plain = InfluenceTracker(final, probes), InfluenceTracker(final, probes)
    cached.use_dataset(data, chunk=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = cached.track(model, opt, data[ids], mask, example_ids=ids)
    assert cached._proj_done.tolist() == [True, True, False]
    torch.testing.assert_close(cached._proj[:16], plain.final_projections(data[:16]), rtol=1e-13, atol=0)
    b = plain.track(model, opt, data[ids], mask)
    assert [(r["feature"], r["component"], r["optimizer"], r["mismatch"]) for r in a] == [
        (r["feature"], r["component"], r["optimizer"], r["mismatch"]) for r in b]
    for x, y in zip(a, b):
        assert x["value"] == pytest.approx(y["value"], rel=1e-10, abs=1e-15)


@pytest.mark.parametrize("kw", REGIMES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "vanilla")
def test_optimizer_step_on_tracked_gradient_is_train_step_bit_for_bit(kw):
    """track() + tracker.optimizer_step() (the replay's step, no second forward and backward) leaves the parameters
    and the optimizer state bit for bit as train_step does, in every regime; float32 as in training."""
    from ntpflow.runs.training import train_step

    cfg = GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D, **kw)
    a, b, final = GPT(cfg, seed=0), GPT(cfg, seed=0), GPT(cfg, seed=1)
    tracker = InfluenceTracker(final, [Probe(Site(1, 3), "f", torch.ones(D)), Probe(Site(2, 6), "g", torch.ones(D))])
    opt_a, opt_b = (torch.optim.Adam(m.parameters(), lr=1e-2, fused=True) for m in (a, b))
    for step in range(3):
        tokens, mask = batch(seed=step)
        train_step(a, opt_a, tokens, mask)
        tracker.track(b, opt_b, tokens, mask)
        tracker.optimizer_step(b, opt_b)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad)  # exact: the same ops in one process: optimizer_step is train_step
            assert all(torch.equal(x, opt_b.state[q][k]) for k, x in opt_a.state[p].items())  # exact: as above
    with pytest.raises(RuntimeError, match="follows a track"):
        tracker.optimizer_step(b, opt_b)


def test_risks_by_type_skip_empty_subsets():
    model, final = tiny(seed=0), tiny(seed=1)
    tokens, mask = batch()
    types = torch.zeros(len(tokens), T, dtype=torch.long)
    types[:2, 4] = 2  # rows 0-1 are type 2, the rest type 0; type 1 absent
    probe = Probe(Site(1, 4), "sq", torch.ones(D, dtype=torch.float64))
    rows = InfluenceTracker(final, [probe]).track(model, torch.optim.SGD(model.parameters(), lr=0.1), tokens, mask,
                                                  {"sq": types})
    risk = {r["feature_type"]: r["value"] for r in rows if r["component"] == "risk" and r["mismatch"] == "paper"}
    centred = {r["feature_type"]: r["value"] for r in rows if r["component"] == "risk" and r["mismatch"] == "centred"}
    assert set(risk) == set(centred) == {-1, 0, 2}
    _, r = model(tokens, return_resid=True)
    _, rs = final(tokens, return_resid=True)
    diff = ((r[1][:, 4] - rs[1][:, 4]) @ probe.w).detach()
    assert risk[2] == pytest.approx(diff[:2].pow(2).mean().item())
    assert risk[-1] == pytest.approx(diff.pow(2).mean().item())
    assert centred[2] == pytest.approx(diff[:2].var(correction=0).item(), abs=1e-12)
    assert centred[-1] == pytest.approx(diff.var(correction=0).item())


@pytest.mark.parametrize("make_opt, match", [
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), "weight_decay"),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "weight_decay"),
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), "Adam and SGD"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, nesterov=True), "no dampening or Nesterov"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, dampening=0.5), "no dampening or Nesterov"),
])
def test_unsupported_optimizers(make_opt, match):
    model, final = tiny(), tiny(seed=1)
    tracker = InfluenceTracker(final, [Probe(Site(1, 2), "f", torch.ones(D, dtype=torch.float64))])
    tokens, mask = batch()
    with pytest.raises(ValueError, match=match):
        tracker.track(model, make_opt(model.parameters()), tokens, mask)


# ---- the two-run protocol on a real (tiny) run ----
TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "steps": 24, "batch_size": 32, "n_train": 512, "n_eval": 256,
        "eval_every": 8, "ckpt_every": 8, "log_every": 4}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "maj"
    train(TrainConfig(**TINY), path, progress=False)
    return path


def test_replay_reproduces_and_writes_tidy_rows(finished_run, tmp_path):
    import pyarrow.parquet as pq

    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    out = attribute(finished_run, AttributionSpec([Site(1, 3), Site(0, 5)], ["is_majority_<0>"]),
                    out_dir=tmp_path / "a", progress=False)
    table = pq.read_table(out / "influence.parquet").to_pylist()
    assert {r["step"] for r in table} == set(range(TINY["steps"]))
    full = [r for r in table if r["component"] == "full" and r["optimizer"] == "adam" and r["layer"] == 1
            and r["mismatch"] == "paper"]
    cum = 0.0
    for r in sorted(full, key=lambda r: r["step"]):
        cum += r["value"]
        assert r["cumulative"] == pytest.approx(cum)
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert {(p["layer"], p["pos"]) for p in summary["probes"]} == {(1, 3), (0, 5)}
    by = {(p["layer"], p["pos"], p["mismatch"]): p for p in summary["probes"]}
    for k, i in ((1, 3), (0, 5)):  # R = R_c + mean², so R_c's offset share is R's and R_c <= R
        paper, centred = by[k, i, "paper"], by[k, i, "centred"]
        assert 0 <= paper["offset_share_R0"] <= 1
        assert centred["R0_eval"] == pytest.approx((1 - paper["offset_share_R0"]) * paper["R0_eval"], rel=1e-4)


def test_adam_only_replay_writes_the_adam_rows_of_a_full_replay(finished_run, tmp_path):
    import pyarrow.parquet as pq

    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    sites, features = [Site(1, 3), Site(0, 5)], ["is_majority_<0>"]
    full = attribute(finished_run, AttributionSpec(sites, features), out_dir=tmp_path / "all", progress=False)
    adam = attribute(finished_run, AttributionSpec(sites, features, sgd_rows=False),
                     out_dir=tmp_path / "adam", progress=False)
    rows = [pq.read_table(o / "influence.parquet").to_pylist() for o in (full, adam)]
    key = lambda r: (r["step"], r["layer"], r["pos"], r["feature"], r["mismatch"], r["component"], r["optimizer"])
    a = {key(r): r["value"] for r in rows[0] if r["optimizer"] != "sgd"}
    b = {key(r): r["value"] for r in rows[1]}
    assert {r["optimizer"] for r in rows[1]} == {"adam", "none"}
    assert a.keys() == b.keys()
    # the same ops on the same values, but the directions are batched differently (m rows per matmul): float32
    # rounding of the tangents, relative to the largest influence
    scale = max(abs(v) for v in a.values())
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5 * scale), k
    with pytest.raises(ValueError, match="other sites/features/rows"):  # one folder never mixes the two
        attribute(finished_run, AttributionSpec(sites, features), out_dir=tmp_path / "adam", progress=False)


def test_replay_detects_divergence(finished_run, tmp_path):
    import shutil

    from ntpflow.files import load_tensors, save_tensors
    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    run = tmp_path / "tampered"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("attribution"))
    tensors = load_tensors(run / "model.safetensors")
    tensors["wte"] = tensors["wte"] + 1e-6
    save_tensors(run / "model.safetensors", tensors, json.loads((run / "model.json").read_text()))  # new checksum
    with pytest.raises(RuntimeError, match="diverged"):
        attribute(run, AttributionSpec([Site(1, 3)], ["is_majority_<0>"]), out_dir=tmp_path / "y", progress=False)


def test_probes_from_another_run_are_refused(finished_run, tmp_path):
    import shutil

    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    other = tmp_path / "other"
    train(TrainConfig(**{**TINY, "seed": 1}), other, progress=False)
    attribute(other, AttributionSpec([Site(1, 3)], ["is_majority_<0>"]), progress=False)  # fits other's probes
    run = tmp_path / "copy"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("attribution", "probes"))
    shutil.copytree(other / "probes", run / "probes")
    with pytest.raises(ValueError, match="another run"):
        attribute(run, AttributionSpec([Site(1, 3)], ["is_majority_<0>"]), progress=False)


def test_replay_needs_initial_weights(finished_run, tmp_path):
    import shutil

    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    run = tmp_path / "noinit"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("attribution", "init.*"))
    with pytest.raises(FileNotFoundError, match="init"):
        attribute(run, AttributionSpec([Site(1, 3)], None), progress=False)


def test_replay_resumes_after_kill(finished_run, tmp_path):
    import pyarrow.parquet as pq

    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    ref = attribute(finished_run, AttributionSpec([Site(1, 3)], ["is_majority_<1>"]),
                    out_dir=tmp_path / "ref", progress=False)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "ntpflow", "-q", "attribute", str(finished_run), "--sites", "1:3",
           "--features", "is_majority_<1>", "--out", str(out)]
    # SIGKILL just after the first resume point is in place (a named fault point: deterministic, no timing)
    env = {**os.environ, "NTPFLOW_FAULT": "attribute:after_checkpoint:kill"}
    assert subprocess.run(cmd, check=False, env=env).returncode == -signal.SIGKILL
    assert list((out / "state").glob("step_*"))
    assert subprocess.run(cmd, check=False).returncode == 0
    a = pq.read_table(ref / "influence.parquet").sort_by([("step", "ascending")]).to_pylist()
    b = pq.read_table(out / "influence.parquet").sort_by([("step", "ascending")]).to_pylist()
    key = lambda r: (r["step"], r["layer"], r["pos"], r["feature"], r["feature_type"], r["component"], r["optimizer"])
    assert sorted(a, key=key) == sorted(b, key=key)
