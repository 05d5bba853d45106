"""Influence matrices (a replay's account, ``attribute --matrices``) and ``ntpflow discover``: wᵀ M_c w
against the probe rows, Σ_c M_c against S_0 − S_T, resume bit for bit, and the generalized eigenvectors."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from ntpflow import GPT, GPTConfig, Site, TrainConfig
from ntpflow.cli import main
from ntpflow.engine.exact import chunk_matrices
from ntpflow.engine.influence import MISMATCHES, InfluenceTracker, Probe
from ntpflow.engine.replay_account import ReplayAccount
from ntpflow.files import load_tensors
from ntpflow.replay.attribution import attribute
from ntpflow.replay.discover import discover, generalized_eig
from ntpflow.replay.from_account import matrices_layout
from ntpflow.replay.matrices import direction_influence, load_matrices
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run

T, V, D = 8, 7, 16
EPS = torch.finfo(torch.float64).eps
COMPS = ("direct", "pre_cached", "shared", "full")


def tiny(seed=0, **kw) -> GPT:
    return GPT(GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D, **kw), seed=seed).double()


def tokens_of(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.rand(n, T, generator=g) > 0.2


def second_moments(model, final, site, held):
    """S and S_c of ``model`` at ``site`` on ``held``, straight from the definition: [2, d, d]."""
    with torch.no_grad():
        r = model(held, return_resid=True, myopic="none")[1][site.layer][:, site.pos]
        r_star = final(held, return_resid=True, myopic="none")[1][site.layer][:, site.pos]
    e = r - r_star
    ec = e - e.mean(0)
    return torch.stack([e.T @ e, ec.T @ ec]) / len(e)


def setup(opt_name, kw=None, levels=(2,), probes_per_site=3):
    """A tracker (the probe rows, by their own projections) and a replay's account (the matrices) of the same steps
    from ``tiny(0)`` toward an arbitrary θ* (``tiny(1)``), each on its own copy of the weights, with the same rule."""
    kw = kw or {}
    model, final = tiny(seed=0, **kw), tiny(seed=1, **kw)
    g = torch.Generator().manual_seed(3)
    sites = (Site(1, 3), Site(2, 5), Site(0, 2))
    probes = [Probe(s, f"f{j}", torch.randn(D, generator=g, dtype=torch.float64))
              for s in sites for j in range(probes_per_site)]
    tracker = InfluenceTracker(final, probes)
    held = tokens_of(99, 10)[0]
    rule = {"levels": levels, "rtol": 0.0 if len(levels) > 1 else 1e-3, "floor": 0.0, "pieces": ()}
    tracker.use_readout(held, **rule)
    with torch.no_grad():
        resid = final(held, return_resid=True, myopic="none")[1]
    r_star = {s: resid[s.layer][:, s.pos] for s in sites}
    twin = copy.deepcopy(model)
    account = ReplayAccount(twin, optimizer(opt_name, twin), probes, held, r_star, **rule)
    return model, final, probes, tracker, held, optimizer(opt_name, model), account


def optimizer(opt_name, model):
    return (torch.optim.Adam(model.parameters(), lr=1e-2) if opt_name == "adam"
            else torch.optim.SGD(model.parameters(), lr=1e-1))


def matrices(account) -> dict[str, torch.Tensor]:
    """The account's influence matrices in ``matrices.safetensors``'s layout (what ``attribute --matrices`` writes)."""
    total = {s: sum(chunk_matrices(t, s, account.r_star[s]) for _, t in account.chunks) for s in account.sites}
    start = {s: account.chunks[0][1][f"start.{s.layer}:{s.pos}"] for s in account.sites}
    return matrices_layout(total, start, account.r_star, account.own, account.names)


def run_steps(model, tracker, opt, steps, start=0, account=None):
    """Track ``steps`` steps (and account for them, if given); the running sums of every tracker row {(probe name,
    site, mismatch, optimizer, comp): value}."""
    totals: dict = {}
    for step in range(start, start + steps):
        rows = tracker.track(model, opt, *tokens_of(step, 6))
        tracker.optimizer_step(model, opt)
        if account is not None:
            account.train_step(*tokens_of(step, 6))
        for r in rows:
            if r["feature_type"] == -1 and r["component"] != "risk":
                key = (r["feature"], Site(r["layer"], r["pos"]), r["mismatch"], r["optimizer"], r["component"])
                totals[key] = totals.get(key, 0.0) + r["value"]
    return totals


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("kw", [{}, {"myopic": "kv"}])
def test_quadratic_forms_are_the_probe_rows(opt_name, kw):
    """For every probe w and component c: wᵀ M_c w equals the integrated probe row (same quadrature points, with
    refinement through 1, 2 and 4 points); Σ_c M_c = M_full; M_full − S_0 + S_T gives each probe's summed residual
    up to R_H at the last step's end (rounding)."""
    model, final, probes, tracker, held, opt, account = setup(opt_name, kw, levels=(1, 2, 4))
    s_start = {p.site: second_moments(model, final, p.site, held) for p in probes}
    totals = run_steps(model, tracker, opt, 3, account=account)
    mats = matrices(account)
    for p in probes:
        key = f"{p.site.layer}:{p.site.pos}"
        s_end = second_moments(model, final, p.site, held)
        for j, m in enumerate(MISMATCHES):
            M = {c: mats[f"M.{key}.{m}.{c}"] for c in COMPS}
            assert torch.equal(M["full"], M["full"].T)
            scale = (p.w @ s_start[p.site][0] @ p.w).item()  # R_H(θ_0) of this probe (paper), the magnitude
            for c in COMPS:
                got = (p.w @ M[c] @ p.w).item()
                assert got == pytest.approx(totals[p.name, p.site, m, opt_name, c], rel=1e-9, abs=1e3 * EPS * scale)
            sum_c = M["direct"] + M["pre_cached"] + M["shared"]  # shared is full − direct − pre: rounding only
            assert (sum_c - M["full"]).abs().max() <= 8 * EPS * max(m_.abs().max() for m_ in M.values())
            if p.site.layer == 2 or kw:  # pre-caching is structurally absent: exactly zero
                assert not M["pre_cached"].any()
            S0 = mats[f"S0.{key}.{m}"]
            assert torch.allclose(S0, s_start[p.site][j], rtol=1e-12, atol=1e3 * EPS * scale)
            gap = (p.w @ (M["full"] - S0 + s_end[j]) @ p.w).item()
            assert gap == pytest.approx(totals[p.name, p.site, m, opt_name, "residual"], rel=1e-6,
                                        abs=1e4 * EPS * scale)


def test_many_points_split_the_change_of_S_to_rounding():
    """With 24 Gauss–Legendre points Σ_c M_c equals S_0 − S_T entry by entry (the quadrature residual is at rounding
    level); with 1 point it does so only at the embedding (layer 0, where e is linear in θ), not above."""
    for levels in ((24,), (1,)):
        model, final, probes, tracker, held, opt, account = setup("adam", levels=levels)
        s_start = {p.site: second_moments(model, final, p.site, held) for p in probes}
        run_steps(model, tracker, opt, 3, account=account)
        mats = matrices(account)
        for site in s_start:
            key = f"{site.layer}:{site.pos}"
            diff = s_start[site] - second_moments(model, final, site, held)
            full = torch.stack([mats[f"M.{key}.{m}.full"] for m in MISMATCHES])
            bound = 1e3 * EPS * s_start[site].abs().max()
            assert bool((full - diff).abs().max() <= bound) == (levels == (24,) or site.layer == 0), (levels, site)


def test_resume_gives_the_same_matrices_bit_for_bit():
    model, final, probes, tracker, held, opt, account = setup("adam", levels=(1, 2, 4))
    for step in range(2):
        account.train_step(*tokens_of(step, 6))
    rule = {"levels": (1, 2, 4), "rtol": 0.0, "floor": 0.0, "pieces": ()}
    twin_model = copy.deepcopy(account.model)
    twin_opt = torch.optim.Adam(twin_model.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(account.opt.state_dict()))
    twin = ReplayAccount(twin_model, twin_opt, probes, held, account.r_star, **rule)
    twin.load_state_dict(copy.deepcopy(account.state_dict()))
    twin.chunks = list(account.chunks)  # the chunks written before the resume point
    for step in range(2, 4):
        account.train_step(*tokens_of(step, 6))
        twin.train_step(*tokens_of(step, 6))
    a, b = matrices(account), matrices(twin)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_generalized_eigenvectors_are_rayleigh_quotients():
    """generalized_eig on a rank-deficient S_0: unit-norm directions in its active subspace whose generalized Rayleigh
    quotients vᵀMv / vᵀS_0v are the eigenvalues; the shares add up to M's trace on the active subspace."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 5, generator=g, dtype=torch.float64)
    S0 = a @ a.T  # rank 5 in 12 dimensions
    b = torch.randn(12, 12, generator=g, dtype=torch.float64)
    M = (b + b.T) / 2
    out = generalized_eig(M, S0, rcond=1e-8)
    assert out["active"] == 5 and out["vectors"].shape == (5, 12)
    for v, lam in zip(out["vectors"], out["values"]):
        assert v.norm().item() == pytest.approx(1.0, abs=1e2 * EPS)
        assert (v @ M @ v / (v @ S0 @ v)).item() == pytest.approx(lam.item(), rel=1e-8, abs=1e-8)
    assert list(out["values"]) == sorted(out["values"].tolist(), reverse=True)
    u = torch.linalg.eigh(S0).eigenvectors[:, -5:]  # the active subspace
    assert sum(out["shares"]).item() == pytest.approx(1.0, rel=1e-9)
    assert torch.trace(u.T @ M @ u).item() == pytest.approx(out["trace_active"], rel=1e-9)


# ---------------------------------------------------------------- a replay and discover


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from ntpflow.runs.training import train

    out = tmp_path_factory.mktemp("matrices") / "run"
    cfg = TrainConfig(task="majority", n_layer=1, d_model=32, n_head=2, steps=12, batch_size=32, n_train=256,
                      n_eval=128, eval_every=6, ckpt_every=4, log_every=2, device="cpu")
    train(cfg, out, progress=False)
    return out


def test_attribute_matrices_file_resume_and_discover(finished_run, tmp_path):
    """attribute --matrices writes matrices.safetensors whose quadratic forms are the summary's probe rows (float32
    run: to float32 rounding); an interrupted replay resumes to the same bits; direction_influence reads any
    direction; discover writes unit-norm directions whose Rayleigh quotients are the reported eigenvalues."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    sites = [Site(1, 3), Site(1, 7)]
    out = attribute(run, AttributionSpec(sites, None, readout=64, block=5, matrices=True), device="cpu", progress=False)
    first = load_tensors(out / "matrices.safetensors")
    summary = json.loads((out / "summary.json").read_text())
    probes = load_or_probe(Run.open(run), "final")
    for e in summary["probes"]:
        site = Site(e["layer"], e["pos"])
        w = probes.direction(site.layer, site.pos, e["feature"]).to(torch.float64)
        got = direction_influence(out, site, w, e["mismatch"])
        for c in ("direct", "pre_cached", "shared", "full"):
            assert got[c] == pytest.approx(e[f"adam_{c}"], rel=1e-4, abs=1e-5 * e["R0_eval"]), c
        assert got["R0"] == pytest.approx(e["R0_eval"], rel=1e-4)
        assert got["residual"] == pytest.approx(e["residual"], rel=1e-3, abs=1e-5 * e["R0_eval"])
    # resumed from the state after step 10: the same bits
    for f in ("influence.parquet", "summary.json", "matrices.safetensors", "matrices.json"):
        (out / f).unlink(missing_ok=True)
    for f in (out / "state").glob("step_000012.*"):
        f.unlink()
    attribute(run, AttributionSpec(sites, None, readout=64, block=5, matrices=True), device="cpu", progress=False)
    again = load_tensors(out / "matrices.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    # discover
    rep = discover(run, Site(1, 7), out_dir=tmp_path / "disc", top=3, null_draws=200, seed=0)
    data = json.loads((tmp_path / "disc" / "discover.json").read_text())
    assert (tmp_path / "disc" / "discover.md").read_text().startswith("# discover")
    mats = load_matrices(out)
    for m in data["mismatches"]:
        S0 = mats.S0(Site(1, 7), m["mismatch"])
        for comp in m["components"]:
            M = mats.M(Site(1, 7), m["mismatch"], comp["component"])
            for d in comp["directions"]:
                v = torch.tensor(d["vector"], dtype=torch.float64)
                assert v.norm().item() == pytest.approx(1.0, abs=1e-12)
                assert (v @ M @ v / (v @ S0 @ v)).item() == pytest.approx(d["eigenvalue"], rel=1e-6, abs=1e-9)
            null = comp["overlap"]["null"]
            assert 0 <= null["mean"] <= null["q95"] <= 1 and 0 <= comp["overlap"]["observed"] <= 1
    assert rep == tmp_path / "disc"
    # compared with a subset of the probes only: the same directions, cosines with those features alone
    discover(run, Site(1, 7), out_dir=tmp_path / "sub", top=3, null_draws=200, seed=0, features=["is_majority_0"])
    sub = json.loads((tmp_path / "sub" / "discover.json").read_text())
    assert sub["features"] == ["is_majority_0"]
    for m, m_all in zip(sub["mismatches"], data["mismatches"]):
        for comp, comp_all in zip(m["components"], m_all["components"]):
            for d, d_all in zip(comp["directions"], comp_all["directions"]):
                assert d["vector"] == d_all["vector"]
                assert d["cosines"] == {"is_majority_0": d_all["cosines"]["is_majority_0"]}


def test_bad_input_is_a_one_line_error_and_writes_nothing(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)

    def fails(argv, fragment):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ntpflow: error: ") and fragment in lines[0], lines

    fails(["attribute", str(run), "--sites", "1:3", "--readout", "129", "--matrices", "--device", "cpu"], "2..128")
    fails(["attribute", str(run), "--sites", "1:3", "--paper", "--matrices", "--device", "cpu"], "exact account")
    fails(["attribute", str(run), "--group", "--sites", "1:3", "--readout", "8", "--matrices"], "single run")
    assert not (run / "attribution").exists()
    fails(["discover", str(run), "--site", "1:3", "--out", str(tmp_path / "d")], "no influence matrices")
    assert not (tmp_path / "d").exists()
    attribute(run, AttributionSpec([Site(1, 3)], ["is_majority_<0>"], readout=8, matrices=True),
              device="cpu", progress=False)
    fails(["discover", str(run), "--site", "1:5", "--out", str(tmp_path / "d")], "1:3")
    fails(["discover", str(run), "--site", "1:3", "--features", "sq_*", "--out", str(tmp_path / "d")], "matches sq_*")
    assert not (tmp_path / "d").exists()


def test_null_draws_spans_as_an_isotropic_components_eigenvectors():
    """The null's overlap with a feature along S_0's smallest direction matches an independent Monte Carlo of the
    whitened draw (S_0 = diag(1, 1, 1, 0.01): v ∝ (z1, z2, z3, 10 z4), cos² with e4 = 100 z4² / |v|²), and is far
    above the uniform draw's 1/4 that a null of plain random directions would give."""
    from ntpflow.replay.discover import _null, generalized_eig

    S0 = torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.01], dtype=torch.float64))
    eig = generalized_eig(torch.eye(4, dtype=torch.float64), S0)
    e4 = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    ov, cos = _null(eig["whitening"], e4.T, e4, 1, 4000, seed=0)
    z = np.random.default_rng(1).standard_normal((200_000, 4))
    expect = (100 * z[:, 3] ** 2 / ((z[:, :3] ** 2).sum(1) + 100 * z[:, 3] ** 2)).mean()
    se = ov.std().item() / 4000 ** 0.5
    assert abs(ov.mean().item() - expect) < 5 * se and expect > 0.8
    assert torch.allclose(cos.pow(2), ov, rtol=1e-12, atol=1e-15)  # one direction: overlap = cos²


def test_small_active_subspace_marks_p_values_and_shares_not_informative(finished_run, tmp_path, capsys):
    """Readout 8: S_0 has at most 8 active dimensions, so with --top 8 every top span is the whole active subspace:
    each row's p (its null is a point mass, p_floor ≈ 1) and shares (they add up to 1 by construction) are marked
    n.i. on the printed lines, in discover.md and in discover.json. With --top 1 the marks follow the same rule, and
    a component that moved nothing at the site (all λ = 0) is n.i. too."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    attribute(run, AttributionSpec([Site(1, 3)], None, readout=8, matrices=True), device="cpu", progress=False)
    assert main(["discover", str(run), "--site", "1:3", "--top", "8", "--null", "200", "--out",
                 str(tmp_path / "d8")]) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "d8" / "discover.json").read_text())
    rows = [line for line in printed.splitlines() if line.startswith("| ") and " / " in line and "component" not in line]
    assert len(rows) == 2 * 4
    for line in rows:
        assert line.endswith(" (n.i.) |") and line.count("(n.i.)") == 2, line
    assert "n.i.: not informative" in printed and printed.count("n.i.: not informative") == 2
    assert "(n.i.)" in (tmp_path / "d8" / "discover.md").read_text()
    for entry in data["mismatches"]:
        for comp in entry["components"]:
            assert comp["active"] <= 8 and comp["overlap"]["m"] == comp["active"]
            null = comp["overlap"]["null"]
            assert not null["informative"] and null["p_floor"] > 0.9 and not comp["p_informative"]
            assert null["attainable"] == pytest.approx(comp["overlap"]["observed"], abs=1e-9)
            assert not comp["shares_informative"]
            total = sum(d["share"] for d in comp["directions"])
            assert total == pytest.approx(1.0, abs=1e-6) or (total == 0 and comp["trace_active"] == 0)
    discover(run, Site(1, 3), out_dir=tmp_path / "d1", top=1, null_draws=200, seed=0)
    for entry in json.loads((tmp_path / "d1" / "discover.json").read_text())["mismatches"]:
        for comp in entry["components"]:
            null = comp["overlap"]["null"]
            moved = any(d["eigenvalue"] != 0 for d in comp["directions"])  # pre-cached may be exactly 0 here
            assert comp["shares_informative"] == (comp["active"] > 1 and moved)
            assert null["informative"] == (null["p_floor"] < 0.05)
            assert comp["p_informative"] == (null["informative"] and moved)
            assert comp["overlap"]["observed"] <= null["attainable"] + 1e-9


def test_p_values_are_informative_only_where_the_null_leaves_room():
    """The rule from the null alone: S_0 with 2 active dimensions and top 2 → every draw is the active plane, p_floor
    ≈ 1 (n.i.); 6 active dimensions and top 2 → a span containing the feature is possible and the null rarely
    reaches it, p_floor = 1/(draws+1) (informative); a feature outside the active plane cannot be reached at all."""
    from ntpflow.replay.discover import _null, _span, _summary, best_overlap

    e1 = torch.eye(6, dtype=torch.float64)[:, :1]
    for diag, informative in (([1, 1, 0, 0, 0, 0], False), ([1, 0.5, 0.3, 0.2, 0.1, 0.05], True)):
        eig = generalized_eig(torch.eye(6, dtype=torch.float64), torch.diag(torch.tensor(diag, dtype=torch.float64)))
        m = min(2, eig["active"])
        ov, _ = _null(eig["whitening"], e1, e1.T, m, 400, seed=0)
        best = best_overlap(_span(eig["whitening"]), e1, m)
        assert best == pytest.approx(1.0)
        s = _summary(ov, ov.mean().item(), best)
        assert s["informative"] is informative
        assert s["p_floor"] == (pytest.approx(1.0) if not informative else pytest.approx(1 / 401))
    e6 = torch.eye(6, dtype=torch.float64)[:, 5:]
    eig = generalized_eig(torch.eye(6, dtype=torch.float64), torch.diag(torch.tensor([1.0, 1, 1, 0, 0, 0],
                                                                                      dtype=torch.float64)))
    assert best_overlap(_span(eig["whitening"]), e6, 2) == pytest.approx(0.0, abs=1e-12)
