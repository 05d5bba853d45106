"""The exact account (``InfluenceTracker.use_readout``, ``attribute --readout``): R on a fixed readout set, each
step's exact change, and the components' path integrals along the step against float64 autograd."""

import copy
import json
import math
import shutil

import pytest
import torch

from ntpflow import GPT, GPTConfig, Site, TrainConfig
from ntpflow.cli import main
from ntpflow.engine.decomposition import decompose, flat_grads
from ntpflow.engine.influence import MISMATCHES, InfluenceTracker, Probe, gauss_legendre, mismatch_value
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.run import Run

T, V, D = 8, 7, 16
EPS = torch.finfo(torch.float64).eps


def tiny(seed=0, **kw) -> GPT:
    return GPT(GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D, **kw), seed=seed).double()


def tokens_of(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.rand(n, T, generator=g) > 0.2


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def at(model, theta):
    """A copy of ``model`` with its weights set to ``theta`` (flat)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for q, b in zip(out.parameters(), theta.split([q.numel() for q in out.parameters()])):
            q.copy_(b.view_as(q))
    return out


def risk(model, final, probe, held, mismatch):
    """R_H of ``probe`` at ``model``'s weights (autograd graph kept)."""
    k, i = probe.site.layer, probe.site.pos
    r = model(held, return_resid=True, myopic="none")[1][k][:, i]
    with torch.no_grad():
        r_star = final(held, return_resid=True, myopic="none")[1][k][:, i]
    return mismatch_value((r - r_star) @ probe.w, mismatch)


def path_gradients(model, final, probes, held, theta, step, n=64):
    """The definition by autograd: {(probe name, mismatch): ∫₀¹ ∇R_H(θ − sΔ) ds [n_params]} with the n-point
    Gauss–Legendre rule; a direction δ's path integral ∫₀¹ ∇R_H(θ − sΔ)·δ ds is its dot product with δ."""
    total = {(p.name, m): 0.0 for p in probes for m in MISMATCHES}
    for s, w in gauss_legendre(n):
        m = at(model, theta - s * step)
        params = list(m.parameters())
        for p in probes:
            for mismatch in MISMATCHES:
                g = torch.autograd.grad(risk(m, final, p, held, mismatch), params, allow_unused=True)
                total[p.name, mismatch] = total[p.name, mismatch] + w * flat_grads(g, params)
    return total


def setup(opt_name, kw=None, levels=(32,), rtol=1e-3, floor=1e-6, pieces=(), cap=1e-3):
    kw = kw or {}
    model, final = tiny(seed=0, **kw), tiny(seed=1, **kw)
    g = torch.Generator().manual_seed(3)
    probes = [Probe(Site(1, 3), "a", torch.randn(D, generator=g, dtype=torch.float64)),
              Probe(Site(2, 5), "b", torch.randn(D, generator=g, dtype=torch.float64))]
    tracker = InfluenceTracker(final, probes)
    held = tokens_of(99, 10)[0]
    tracker.use_readout(held, levels=levels, rtol=rtol, floor=floor, pieces=pieces, cap=cap)
    lr = 1e-2 if opt_name == "adam" else 1e-1
    opt = (torch.optim.Adam(model.parameters(), lr=lr) if opt_name == "adam"
           else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9 if opt_name == "momentum" else 0.0))
    return model, final, probes, tracker, held, opt, lr


def value(rows, p, m, optimizer, component):
    (v,) = [r["value"] for r in rows if r["feature"] == p.name and r["mismatch"] == m and r["optimizer"] == optimizer
            and r["component"] == component and r["feature_type"] == -1]
    return v


@pytest.mark.parametrize("opt_name", ["adam", "sgd", "momentum"])
@pytest.mark.parametrize("kw", [{}, {"myopic": "kv"}])
def test_path_integrals_match_autograd_and_add_up_to_the_exact_change(opt_name, kw):
    """Each component's integral (SGD rows: lr·∫∇R_H·g_c with the decomposition's g_c at θ_t; momentum rows:
    lr·∫∇R_H·m_c with m_c ← 0.9 m_c + g_c summed here from the decomposition's parts; the full Adam, SGD or momentum
    step: ∫∇R_H·Δ) against a 64-point autograd path integral of the definition (the gradient integrated along the
    step, then dotted with each direction); the components add up to the full;
    with 32 points the residual against the exact change is at rounding level; risk rows are R_H(θ_t)."""
    model, final, probes, tracker, held, opt, lr = setup(opt_name, kw)
    buffers = {c: 0.0 for c in ("direct", "pre_cached", "shared")}  # momentum: the components' own buffers
    for step in range(3):
        tokens, mask = tokens_of(step, 6)
        theta = flat(model)
        parts = decompose(model, tokens, [probes[0].site], mask)[probes[0].site].as_dict()
        buffers = {c: 0.9 * b + parts[c] for c, b in buffers.items()}
        rows = tracker.track(model, opt, tokens, mask)
        tracker.optimizer_step(model, opt)
        real = theta - flat(model)  # the subtracted step
        grads = path_gradients(model, final, probes, held, theta, real)
        for p in probes:
            for m in MISMATCHES:
                r0, r1 = (risk(at(model, x), final, p, held, m).item() for x in (theta, theta - real))
                assert value(rows, p, m, "none", "risk") == pytest.approx(r0, rel=1e-12)
                change = value(rows, p, m, "none", "change")
                assert change == pytest.approx(r0 - r1, rel=1e-9, abs=1e-13)
                full = value(rows, p, m, opt_name, "full")
                ref = torch.dot(grads[p.name, m], real).item()
                assert full == pytest.approx(ref, rel=1e-8, abs=1e-13)
                comps = [value(rows, p, m, opt_name, c) for c in ("direct", "pre_cached", "shared")]
                assert sum(comps) == pytest.approx(full, rel=1e-10, abs=1e-14)
                residual = value(rows, p, m, opt_name, "residual")
                assert residual == pytest.approx(full - change, rel=1e-9, abs=1e-15)
                scale = sum(risk(at(model, x), final, p, held, "paper").item() for x in (theta, theta - real))
                assert abs(residual) <= 1e3 * EPS * scale  # 32 points: rounding of the R (mean d²) it differences
                if p.name == "a":  # the decomposition's components are of site ⟨1, 3⟩
                    for c in ("direct", "pre_cached", "shared"):
                        ref_c = lr * torch.dot(grads[p.name, m], parts[c]).item()
                        assert value(rows, p, m, "sgd", c) == pytest.approx(ref_c, rel=1e-8, abs=1e-13)
                        if opt_name == "momentum":
                            ref_m = lr * torch.dot(grads[p.name, m], buffers[c]).item()
                            assert value(rows, p, m, "momentum", c) == pytest.approx(ref_m, rel=1e-8, abs=1e-13)


def test_changes_telescope_and_refinement_counts():
    """Σ_t change = R_H(θ_0) − R_H(θ_T) from the weights; with a zero tolerance every step goes through every level
    (1 + 2 + 4 points), with a huge one none is refined; resuming from a state_dict gives the same rows."""
    model, final, probes, tracker, held, opt, lr = setup("adam", levels=(1, 2, 4), rtol=0.0, floor=0.0)
    start = [(p, m, risk(model, final, p, held, m).item()) for p in probes for m in MISMATCHES]
    total = {(p.name, m): 0.0 for p in probes for m in MISMATCHES}
    for step in range(4):
        tokens, mask = tokens_of(step, 6)
        if step == 2:  # resume a copy from here: same rows, same counters
            twin = InfluenceTracker(final, probes)
            twin.use_readout(held, levels=(1, 2, 4), rtol=0.0, floor=0.0, pieces=())
            twin.load_state_dict(copy.deepcopy(tracker.state_dict()))
            twin_model = copy.deepcopy(model)
            twin_opt = torch.optim.Adam(twin_model.parameters(), lr=lr)
            twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            twin_rows = twin.track(twin_model, twin_opt, tokens, mask)
        rows = tracker.track(model, opt, tokens, mask)
        if step == 2:
            assert [r["value"] for r in rows] == [r["value"] for r in twin_rows]
            assert (twin.refined, twin.evaluations) == (tracker.refined, tracker.evaluations)
        tracker.optimizer_step(model, opt)
        for r in rows:
            if r["component"] == "change" and r["feature_type"] == -1:
                total[r["feature"], r["mismatch"]] += r["value"]
    for p, m, r0 in start:
        rT = risk(model, final, p, held, m).item()
        assert total[p.name, m] == pytest.approx(r0 - rT, rel=1e-10, abs=1e-12)
    assert (tracker.refined, tracker.evaluations) == (4, 4 * 7)
    model, final, probes, lazy, held, opt, lr = setup("adam", levels=(1, 2, 4), rtol=1e9, floor=1e9)
    for step in range(2):
        lazy.track(model, opt, *tokens_of(step, 6))
        lazy.optimizer_step(model, opt)
    assert (lazy.refined, lazy.evaluations) == (0, 2)


@pytest.mark.parametrize("cap, counts", [(1.0, (2, 1, 2 * 14 + 16)), (1e-3, (2, 2, 2 * 14 + 2 * 16 + 2 * 32 + 64))])
def test_a_hard_step_converges_when_split_into_pieces(cap, counts):
    """A learning rate of 0.1 makes a step whose 8-point residual exceeds the tolerance (checked: without pieces some
    row fails against the exact change from plain forwards); split into pieces every row settles within it, the
    counters say so (2 + 4 + 8 points per step, then 8 per piece: uncapped (cap 1), only the first step is split,
    in two; capped at 10⁻³ R_H(θ_0), the first settles at 4 pieces and the second at 8), a step that settles without
    pieces has the same rows bit for bit, and resuming from a state_dict gives the same rows and counters."""
    def hard(pieces):
        model, final, probes, tracker, held, opt, lr = setup("adam", levels=(2, 4, 8), pieces=pieces, cap=cap)
        for g in opt.param_groups:
            g["lr"] = 0.1
        return model, final, probes, tracker, held, opt

    ratios, steps_rows = {}, {}
    for pieces in ((), (2, 4, 8, 16)):
        model, final, probes, tracker, held, opt = hard(pieces)
        r0 = {(p.name, m): risk(model, final, p, held, m).item() for p in probes for m in MISMATCHES}
        worst, steps_rows[pieces], split = 0.0, [], []
        for step in range(2):
            tokens, mask = tokens_of(step, 6)
            if step == 1 and pieces:  # resume a copy from here: same rows, same counters
                twin = InfluenceTracker(final, probes)
                twin.use_readout(held, pieces=pieces, cap=cap)
                twin.load_state_dict(copy.deepcopy(tracker.state_dict()))
                twin_model = copy.deepcopy(model)
                twin_opt = torch.optim.Adam(twin_model.parameters(), lr=0.1)
                twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                twin_rows = twin.track(twin_model, twin_opt, tokens, mask)
            before, done = copy.deepcopy(model), tracker.subdivided
            rows = tracker.track(model, opt, tokens, mask)
            tracker.optimizer_step(model, opt)
            steps_rows[pieces].append(rows)
            split.append(tracker.subdivided > done)
            for p in probes:
                for m in MISMATCHES:
                    change = (risk(before, final, p, held, m) - risk(model, final, p, held, m)).item()
                    full = value(rows, p, m, "adam", "full")
                    tol = (min(1e-3 * abs(change), cap * abs(r0[p.name, m])) + 1e-6 * abs(r0[p.name, m])
                           + 1e4 * EPS * abs(r0[p.name, m]))
                    worst = max(worst, abs(full - change) / tol)
            if step == 1 and pieces:
                assert [r["value"] for r in rows] == [r["value"] for r in twin_rows]
                assert (twin.refined, twin.evaluations, twin.subdivided) == (tracker.refined, tracker.evaluations,
                                                                             tracker.subdivided)
        ratios[pieces] = worst
        if pieces:
            assert (tracker.refined, tracker.subdivided, tracker.evaluations) == counts
            for a, b, was_split in zip(steps_rows[()], steps_rows[pieces], split):
                if not was_split:
                    assert [r["value"] for r in a] == [r["value"] for r in b]
    assert ratios[()] > 1 >= ratios[(2, 4, 8, 16)]


def test_pieces_must_increase():
    model, final, probes, tracker, held, opt, lr = setup("adam")
    for bad in ((1, 2), (4, 2), (2, 2)):
        with pytest.raises(ValueError, match="pieces"):
            tracker.use_readout(held, pieces=bad)


def test_readout_set_needs_two_sequences():
    model, final, probes, tracker, held, opt, lr = setup("adam")
    with pytest.raises(ValueError, match="at least 2"):
        tracker.use_readout(held[:1])


def test_tolerance_is_capped_by_the_budget():
    """min(rtol |change|, cap R_0) + floor R_0, by hand: a step that moves R_H by 24 R_0 may not keep 2.4 % of it."""
    from ntpflow.engine.influence import Readout

    ro = Readout(torch.zeros(2, 1), torch.zeros(2, 1), None, (2,), rtol=1e-2, floor=1e-6, cap=1e-3)
    tol = ro.tolerance(torch.tensor([24.0, -0.05, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
    assert tol.tolist() == pytest.approx([1e-3 + 1e-6, 5e-4 + 1e-6, 2e-6], rel=4 * EPS)


def test_composite_rules_stop_when_they_stop_helping():
    """Readout.excess and Readout.settles by hand: Gauss levels and the first split go on while a risk is out of
    tolerance; a split that does not halve the worst excess of the split before it ends the refinement (what is
    left is the exact change's rounding)."""
    from ntpflow.engine.influence import Readout

    ro = Readout(torch.zeros(2, 1), torch.zeros(2, 1), None, (2, 4, 8), rtol=1e-3, floor=0.0, pieces=(2, 4, 8),
                 cap=1.0)
    assert ro.rules == [(2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (8, 8)]
    f64 = dict(dtype=torch.float64)
    change, r0 = torch.tensor([2.0, 1.0, 0.0], **f64), torch.tensor([1.0, 1.0, 1.0], **f64)
    full = change + torch.tensor([1e-3, 5e-3, 0.0], **f64)  # tolerances 2e-3, 1e-3, 0: excess 0.5, 5, 0
    assert ro.excess(change, full, r0).item() == pytest.approx(5.0, rel=4 * EPS)
    assert ro.excess(change, change + torch.tensor([0.0, 0.0, 1e-9], **f64), r0).item() == math.inf
    assert not ro.settles(0, 5.0, math.inf) and not ro.settles(1, 4.9, 5.0)  # Gauss levels: no stall
    assert ro.settles(1, 1.0, 5.0)  # within tolerance
    assert not ro.settles(3, 4.9, 5.0)  # the first split: no stall (the step may be short of Gauss's convergence)
    assert not ro.settles(4, 2.4, 5.0) and ro.settles(4, 2.6, 5.0)  # halved the first split's excess or not
    assert not ro.settles(4, math.inf, math.inf)  # a zero tolerance refines to the last rule
    assert ro.settles(5, 100.0, 1.0)  # the last rule


def test_resume_point_written_before_the_cap():
    """A resume point that stored floor · |R_H(θ_0)| ("readout.floor") restores |R_H(θ_0)| itself."""
    model, final, probes, tracker, held, opt, lr = setup("adam", levels=(2,))
    tokens, mask = tokens_of(0, 6)
    tracker.track(model, opt, tokens, mask)
    tracker.optimizer_step(model, opt)
    state = tracker.state_dict()
    r0 = state.pop("readout.r0")
    state["readout.floor"] = 1e-6 * r0
    twin = InfluenceTracker(final, probes)
    twin.use_readout(held, levels=(2,))
    twin.load_state_dict(state)
    assert torch.allclose(twin._r0, r0, rtol=4 * EPS, atol=0)


# ---------------------------------------------------------------- a replay


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from ntpflow.runs.training import train

    out = tmp_path_factory.mktemp("exact") / "run"
    cfg = TrainConfig(task="majority", n_layer=1, d_model=32, n_head=2, steps=12, batch_size=32, n_train=256,
                      n_eval=128, eval_every=6, ckpt_every=4, log_every=2, device="cpu")
    train(cfg, out, progress=False)
    return out


def test_attribute_with_readout_reports_residuals(finished_run, tmp_path, caplog):
    """summary.json: per row the components' totals, Σ exact changes (= R_H(θ_0) − R_H(θ_T) from the saved weights,
    to float32 rounding) and the residual (= full − change); the last log line says PASS per mismatch."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with caplog.at_level("INFO"):
        out = attribute(run, AttributionSpec([Site(1, 3), Site(1, 7)], ["is_majority_<0>"], readout=64, block=5),
                        device="cpu", progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["readout"] == 64 and 0 <= summary["refined_steps"] <= 12
    assert json.loads((out / "spec.json").read_text())["readout"] == 64
    for e in summary["probes"]:
        assert e["adam_direct"] + e["adam_pre_cached"] + e["adam_shared"] == pytest.approx(e["adam_full"], rel=1e-6,
                                                                                          abs=1e-9)
        assert e["residual"] == pytest.approx(e["adam_full"] - e["change"], rel=1e-6, abs=1e-9 * e["R0_eval"])
        assert e["change"] == pytest.approx(e["R0_minus_RT_eval"], rel=1e-3, abs=1e-5 * e["R0_eval"])
        assert abs(e["residual"]) <= 0.01 * e["R0_eval"]
    *_, head, paper, centred, kappa_paper, kappa_centred = caplog.messages
    for line, mismatch in ((kappa_paper, "paper"), (kappa_centred, "centred")):  # κ of both readings, and signs
        rows = [e for e in summary["probes"] if e["mismatch"] == mismatch]
        worst = max(e["kappa_adam"] for e in rows)
        assert line.startswith(f"{tmp_path.name}/run: conditioning, {mismatch}: κ (adam) median ")
        assert f"largest {worst:.3g}; κ_steps (adam)" in line and "κ (sgd)" in line
        agree = sum(v for e in rows for v in e["signs_agree"].values())
        assert line.endswith(f"adam and sgd agree in sign on {agree}/{3 * len(rows)} components")
    assert head.endswith("with the exact account on a readout of 64; "
                         f"{summary['refined_steps']}/12 steps refined ({summary['subdivided_steps']} split into "
                         "pieces); integrated full influence / (the exact change): median 1 over 2 probes "
                         "(1 = balanced)")
    for line, mismatch in ((paper, "paper"), (centred, "centred")):
        worst = max(abs(e["residual"]) / e["R0_eval"] for e in summary["probes"] if e["mismatch"] == mismatch)
        assert line == f"{tmp_path.name}/run: exact account, {mismatch}: largest |residual| / R_H(θ_0) {worst:.2e} PASS (≤ 0.01)"
    # resumed from the state after step 10 (the last one lost): the same summary, counters included
    (out / "influence.parquet").unlink()
    (out / "summary.json").unlink()
    for f in (out / "state").glob("step_000012.*"):
        f.unlink()
    with caplog.at_level("INFO"):
        attribute(run, AttributionSpec([Site(1, 3), Site(1, 7)], ["is_majority_<0>"], readout=64, block=5),
                  device="cpu", progress=False)
    assert any("from step 10" in m for m in caplog.messages)
    again = json.loads((out / "summary.json").read_text())
    assert again["refined_steps"] == summary["refined_steps"]
    assert again["point_evaluations"] == summary["point_evaluations"]
    for e, f in zip(summary["probes"], again["probes"]):
        assert e.keys() == f.keys()
        for k in ("adam_full", "adam_direct", "change", "residual"):
            assert f[k] == pytest.approx(e[k], rel=1e-12, abs=1e-15), k
    # the same folder without --readout: a one-line refusal naming it
    with pytest.raises(ValueError, match="exact account on a readout of 64"):
        attribute(run, AttributionSpec([Site(1, 3), Site(1, 7)], ["is_majority_<0>"]), device="cpu", progress=False)
    assert Run.open(run).done


@pytest.mark.parametrize("n,fragment", [("129", "2..128"), ("1", "2..128"), ("0", "2..128")])
def test_attribute_bad_readout_is_a_one_line_error_and_writes_nothing(finished_run, tmp_path, capsys, n, fragment):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert main(["attribute", str(run), "--sites", "1:3", "--readout", n, "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ntpflow: error: ") and fragment in lines[0], lines
    assert not (run / "attribution").exists()
