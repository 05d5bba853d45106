"""The OthelloGPT reproduction: the smoke scale end to end (structure and resumability, no paper result asserted),
the 3-way classifier probe against an independent sklearn computation, and the report's statistics on a hand-made
data.json."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from _util import all_numbers

import ntpflow.experiments.othello as othello
from ntpflow.experiments.claims import NOT_TESTABLE
from ntpflow.experiments.othello import CENTRAL_SQUARES, SCALES, run_othello
from ntpflow.experiments.othello_probes import ClassifierProbes, board_classes, fit_classifier
from ntpflow.experiments.othello_report import summarize, write_report
from ntpflow.stats import slope, stats

# ---------------------------------------------------------------------------------------------------- smoke, end to end


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("othello") / "smoke"
    assert run_othello("smoke", out, device="cpu", progress=False, workers=2) == out  # the two runs side by side
    return out


@pytest.mark.one_thread
def test_smoke_files_and_schema(smoke):
    for name in ("data.json", "summary.json", "report.md", "report.html", "timings.json"):
        assert (smoke / name).exists(), name
    for fig in ("training", "probe_by_layer", "probe_by_move", "gap", "influence_bars", "influence_curves"):
        assert (smoke / "figures" / f"{fig}.png").exists() and (smoke / "figures" / f"{fig}.svg").exists(), fig
    run = smoke / "run"
    for name in ("DONE", "model.safetensors", "probes/probes.json", "probes_init/probes.json", "classifier_final.json",
                 "classifier_init.json", "attribution/influence.parquet"):
        assert (run / name).exists(), name

    data = json.loads((smoke / "data.json").read_text())
    for key in ("scale", "config", "sites", "squares", "run", "eval_curve", "probes", "influence", "curves"):
        assert key in data, key
    assert data["scale"] == "smoke" and 0.0 <= data["run"]["legal_acc"] <= 1.0
    # reproduce replays with the exact account by default; the replay's spec and the report say so
    assert data["influence_read_at"] == "exact"
    spec = json.loads((smoke / "run" / "attribution" / "spec.json").read_text())
    assert spec["readout"] == min(256, data["config"]["n_eval"]) and spec["midpoint"] is False
    assert "| influence read | the exact account: a fixed readout set," in (smoke / "report.md").read_text()
    scale = SCALES["smoke"]
    assert {tuple(s) for s in data["sites"]} == {(s.layer, s.pos) for s in scale.sites}
    combos = {(r["weights"], r["metric"]) for r in data["probes"]}
    assert combos == {(w, m) for w in ("final", "init") for m in ("r", "acc")}
    assert all(len(r["values"]) == 64 for r in data["probes"])
    types = {r["type"] for r in data["probes"]}
    assert {"all", "useless", "useful"} <= types
    assert {r["square"] for r in data["influence"]} == set(scale.squares)
    assert {"useful", "useless", "all"} <= {r["type"] for r in data["influence"]}
    assert {"direct", "pre_cached", "shared", "full"} <= {r["component"] for r in data["influence"]}
    assert all(math.isfinite(r["total"]) for r in data["influence"])
    # the components add up to the full step, per unit
    tot = {(r["layer"], r["pos"], r["square"], r["type"], r["component"]): r["total"] for r in data["influence"]}
    for (k, p, sq, t, c), v in tot.items():
        if c == "full":
            parts = sum(tot[(k, p, sq, t, x)] for x in ("direct", "pre_cached", "shared"))
            assert parts == pytest.approx(v, rel=1e-6, abs=1e-9)
    # the balance check: one entry per tracked site x square (of the paper's R; the centred R_c has its own)
    sanity = [(r["layer"], r["pos"], r["square"]) for r in data["sanity"]]
    assert sorted(sanity) == sorted({(s.layer, s.pos, q) for s in scale.sites for q in scale.squares})
    # R_c beside R: centred influence per unit, and the held-out records per site x square x mismatch
    units = {(r["layer"], r["pos"], r["square"], r["type"], r["component"]) for r in data["influence_centred"]}
    assert units == set(tot)
    held_out = sorted((r["layer"], r["pos"], r["square"], r["mismatch"]) for r in data["mismatch"])
    assert held_out == sorted((s, p, q, m) for s, p, q in sanity for m in ("centred", "paper"))
    assert all(0.0 <= r["offset_share_R0"] <= 1.0 for r in data["mismatch"])

    summary = json.loads((smoke / "summary.json").read_text())
    assert all(math.isfinite(x) for x in all_numbers(summary))
    claims = summary["claims"]
    assert [c["id"] for c in claims] == ["i", "ii", "iii", "iv"]
    assert all(c["measured"] for c in claims)
    # a smoke model knows nothing of the board: every claim says so instead of a verdict
    assert all(c["verdict"] == NOT_TESTABLE for c in claims)
    assert all(not p["ok"] for c in claims for p in c["preconditions"] if p["name"].startswith("a world model: legal"))
    html = (smoke / "report.html").read_text()
    assert 'id="claims"' in html and 'id="influence"' in html
    md = (smoke / "report.md").read_text()
    assert "NOT the paper's setting" in md and "positive = the component moved the feature toward its final value" in md
    assert "| layer | position | squares' type | offset share of R₀ | R_c: direct / pre-cached / shared |" in md
    assert len(summary["mismatch_by_site"]) == len(scale.sites) * 3 and summary["centred_recorded"]
    assert "not recorded in this run" not in md


@pytest.mark.one_thread
def test_second_call_does_not_redo_stages(smoke):
    run = smoke / "run"
    watched = [run / "model.safetensors", run / "probes" / "probes.safetensors", run / "probes_init" /
               "probes.safetensors", run / "classifier_final.safetensors", run / "classifier_init.safetensors",
               run / "attribution" / "influence.parquet", smoke / "timings.json",
               smoke / "myopic" / "run" / "model.safetensors", smoke / "myopic" / "run" / "probes" / "probes.safetensors",
               smoke / "fragility" / "fragility.json"]
    mtimes = {p: p.stat().st_mtime_ns for p in watched}
    before = {p: p.read_bytes() for p in (smoke / "report.md", smoke / "summary.json", smoke / "data.json")}
    run_othello("smoke", smoke, device="cpu", progress=False)
    assert {p: p.stat().st_mtime_ns for p in watched} == mtimes
    for p, content in before.items():
        assert p.read_bytes() == content, p.name


@pytest.mark.one_thread
def test_report_of_the_vanilla_run_comes_before_the_myopic_training(smoke, tmp_path, monkeypatch):
    """Claim (i) and the gates need only the vanilla run: its report is written before the myopic run trains, so a
    myopic training that fails (or is stopped) leaves it."""
    out = tmp_path / "out"
    shutil.copytree(smoke / "run", out / "run")
    real_train = othello.train

    def train(cfg, run_dir, **kw):
        if cfg.regime == "myopic":
            raise RuntimeError("stopped before the myopic run")
        return real_train(cfg, run_dir, **kw)

    monkeypatch.setattr(othello, "train", train)
    with pytest.raises(RuntimeError, match="stopped before the myopic run"):
        run_othello("smoke", out, device="cpu", progress=False, replays=False)
    report = (out / "report.md").read_text()
    assert "## Fragility" not in report and "## Fragility" in (smoke / "report.md").read_text()
    data, full = json.loads((out / "data.json").read_text()), json.loads((smoke / "data.json").read_text())
    assert data["probes"] == full["probes"] and data["fragility"] is None


@pytest.mark.one_thread
def test_runs_trained_side_by_side_are_those_trained_in_turn(smoke, tmp_path):
    """workers=2 trains the vanilla and the myopic run in worker processes at the same time; each one's weights are
    byte for byte those of the same run trained in this process, in turn (workers=1), and each worker's CPU time is
    recorded as its stage's."""
    out = tmp_path / "turns"
    run_othello("smoke", out, device="cpu", progress=False, replays=False, workers=1)
    for run in ("run", "myopic/run"):
        assert (out / run / "model.safetensors").read_bytes() == (smoke / run / "model.safetensors").read_bytes(), run
    timings = json.loads((smoke / "timings.json").read_text())
    assert all(timings["cpu_s"][stage] > 0 and timings[stage] > 0 for stage in ("train", "train_myopic"))


@pytest.mark.one_thread
def test_sanity_line_of_the_exact_account_says_the_two_sides_are_one_quantity(smoke):
    """Read with the exact account (the smoke run keeps it while training), the full influence and the mismatch
    removed are the same change of R on the readout, not a first-order approximation of it."""
    report = (smoke / "report.md").read_text()
    summary = json.loads((smoke / "summary.json").read_text())
    assert summary["exact_account"] is not None
    assert "equal up to the account's quadrature residual" in report and "agree only to first order" not in report


@pytest.mark.one_thread
def test_a_resumed_training_is_timed_over_its_own_steps(smoke, tmp_path):
    """A call cut off before it recorded its time leaves no record, so the call that resumes the run times only the
    steps it trains: its seconds per step are read over those, and the report says so."""
    timings = json.loads((smoke / "timings.json").read_text())
    steps = SCALES["smoke"].config().steps
    assert timings["steps"] == {"train": steps, "train_myopic": steps}  # trained whole, side by side
    out = tmp_path / "cut"
    shutil.copytree(smoke, out)
    run = out / "run"
    for name in ("DONE", "model.safetensors", "model.json", "optimizer.safetensors", "timings.json"):
        (run / name if name != "timings.json" else out / name).unlink()
    for f in (run / "ckpt").glob(f"step_{steps:06d}*"):
        f.unlink()
    run_othello("smoke", out, device="cpu", progress=False, workers=1)
    resumed = json.loads((out / "timings.json").read_text())
    assert resumed["steps"] == {"train": steps - 6}  # from its checkpoint at step 6; the myopic run was done
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step_times"]["train_s_per_step"] == resumed["train"] / (steps - 6)
    assert "tracked_s_per_step" not in summary["step_times"]  # the influence was read from the kept account
    labels = [r["label"] for r in summary["cpu_time"]["stages"]]
    assert f"training (vanilla, with the account), the last {steps - 6} of {steps} steps" in labels
    assert (run / "model.safetensors").read_bytes() == (smoke / "run" / "model.safetensors").read_bytes()


@pytest.mark.one_thread
def test_myopic_run_is_the_vanilla_config_in_regime_myopic(smoke):
    vanilla, myopic = (json.loads((d / "config.json").read_text()) for d in (smoke / "run", smoke / "myopic" / "run"))
    assert myopic["train"]["regime"] == "myopic" and vanilla["train"]["regime"] == "vanilla"
    assert myopic["train"]["seed"] == vanilla["train"]["seed"] == SCALES["smoke"].config().seed
    assert {k: v for k, v in myopic["train"].items() if k != "regime"} == {
        k: v for k, v in vanilla["train"].items() if k != "regime"}
    assert myopic["model"]["myopic"] != "none" and vanilla["model"]["myopic"] == "none"
    timings = json.loads((smoke / "timings.json").read_text())
    stages = {"train", "train_myopic", "probes_final", "probes_init", "classifier_final", "classifier_init",
              "probes_myopic", "fragility", "attribution"}
    assert set(timings["cpu_s"]) == stages and stages <= set(timings)
    assert all(v >= 0 for v in timings["cpu_s"].values())


def _fmt_ci(r, m):
    """A fragility row's ``m`` as the report prints it, formatted here from fragility.json's numbers."""
    lo, hi = r[f"{m}_lo"], r[f"{m}_hi"]
    return f"{r[m]:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else f" (n={r['n_pairs']})")


@pytest.mark.one_thread
def test_fragility_section_shows_the_files_numbers(smoke):
    frag = json.loads((smoke / "fragility" / "fragility.json").read_text())
    md = (smoke / "report.md").read_text()
    section = md[md.index("## Fragility"):]
    assert set(frag["rows"]) == {"vanilla", "myopic"} and frag["runs"] == {"vanilla": "../run",
                                                                           "myopic": "../myopic/run"}
    assert f"position {frag['t']}: {frag['pairs']['useless']} **useless** pairs" in section
    n_rows = 0
    for regime, rows in frag["rows"].items():
        for r in rows:
            line = (f"| {regime} | {r['layer']} | {r['kind']} | {r['n_pairs']} | {_fmt_ci(r, 'probe_acc')} | "
                    f"{_fmt_ci(r, 'which_acc')} (n={r['n_held_out']}) | {_fmt_ci(r, 'distance')} |")
            assert line in section, line
            n_rows += 1
            assert r["n_pairs"] == frag["pairs"][r["kind"]]
    assert n_rows == 2 * 2 * (SCALES["smoke"].train["n_layer"] + 1)
    mid = {c["regime"]: c for c in frag["comparisons"] if c["metric"] == "probe_acc" and c["layer"] == "middle"}
    assert set(mid) == {"vanilla", "myopic", "myopic − vanilla"}
    # the gap of the middle layer (layer 1 of 2) is the rows' useful − useless, recomputed here from the rows
    rows = {(r["kind"], r["layer"]): r for r in frag["rows"]["vanilla"]}
    assert mid["vanilla"]["mean"] == pytest.approx(rows["useful", 1]["probe_acc"] - rows["useless", 1]["probe_acc"],
                                                   abs=1e-12)
    g = mid["vanilla"]
    assert f"| probe_acc | middle | vanilla | {g['mean']:.3g} [{g['lo']:.3g}, {g['hi']:.3g}] |" in section
    # a smoke model has no world model: both predictions are gated, with the reason, and the numbers still shown
    summary = json.loads((smoke / "summary.json").read_text())
    claims = summary["fragility"]["claims"]
    assert [c["verdict"] for c in claims] == [NOT_TESTABLE] * 2
    assert "Prediction (a): not testable at this scale, because vanilla: a world model: legal-move accuracy" in section
    assert "Prediction (b): not testable at this scale, because" in section and "myopic: a world model" in section


def test_bad_scale_is_a_clean_error(tmp_path):
    with pytest.raises(ValueError, match="unknown scale"):
        run_othello("huge", tmp_path / "x")


def test_scales_track_central_squares():
    assert len(CENTRAL_SQUARES) == 16 and CENTRAL_SQUARES[0] == "sq_C3" and CENTRAL_SQUARES[-1] == "sq_F6"
    paper = SCALES["paper"]
    assert paper.squares == CENTRAL_SQUARES
    assert {(s.layer, s.pos) for s in paper.sites} == {(k, p) for k in range(1, 7) for p in range(4, 57, 4)}
    assert paper.train["n_layer"] == 6 and paper.train["d_model"] == 256 and paper.train["batch_size"] == 1024
    assert SCALES["small"].squares == CENTRAL_SQUARES


# ---------------------------------------------------------------------------------------------------- classifier


def _synthetic(seed=0, L1=2, n=200, T=3, d=6, F=3):
    g = np.random.default_rng(seed)
    resid = g.normal(size=(L1, n, T, d))
    score = resid[-1, :, :, :F] + 0.4 * g.normal(size=(n, T, F))  # the last layer predicts the class best
    feats = np.where(score > 0.5, 1.0, np.where(score < -0.5, -1.0, 0.0))
    types = g.integers(0, 3, size=(n, T, F))
    return resid, feats, types


def test_classifier_matches_sklearn():
    from sklearn.linear_model import Ridge

    resid, feats, types = _synthetic()
    L1, n, T, _ = resid.shape
    F = feats.shape[2]
    got = fit_classifier(torch.tensor(resid), torch.tensor(feats), alpha=1.0, train_frac=0.7,
                         feature_types=torch.tensor(types), pos_chunk=2)
    n_tr = math.floor(0.7 * n)
    cls = np.where(feats == 1, 1, np.where(feats == -1, 2, 0))
    assert np.isnan(got.acc[:, 0].numpy()).all()  # position 0 is not probed
    for k in range(L1):
        for p in range(1, T):
            X = resid[k, :, p]
            Y = np.concatenate([np.eye(3)[cls[:, p, f]] for f in range(F)], axis=1)
            pred = Ridge(alpha=1.0).fit(X[:n_tr], Y[:n_tr]).predict(X[n_tr:]).reshape(n - n_tr, F, 3).argmax(-1)
            hit = pred == cls[n_tr:, p]
            np.testing.assert_allclose(got.acc[k, p].numpy(), hit.mean(0), atol=1e-12)
            for t in (0, 1, 2):
                m = types[n_tr:, p] == t
                want = np.array([hit[m[:, f], f].mean() if m[:, f].any() else np.nan for f in range(F)])
                np.testing.assert_allclose(got.acc_by_type[t][k, p].numpy(), want, atol=1e-12)
                np.testing.assert_array_equal(got.count_by_type[t][p].numpy(), m.sum(0))
    assert got.acc[1, 1:].mean() > got.acc[0, 1:].mean()  # the informative layer is decoded better


def test_classifier_separable_case_is_perfect(tmp_path):
    g = np.random.default_rng(1)
    n, T = 90, 4
    cls = g.integers(0, 3, size=(n, T, 2))
    resid = np.eye(3)[cls].reshape(n, T, 6)[None] * 5.0  # one-hot of both squares' classes: separable
    feats = np.choose(cls, [0.0, 1.0, -1.0])
    got = fit_classifier(torch.tensor(resid), torch.tensor(feats), alpha=1e-3, positions=[1, 3])
    assert torch.equal(got.acc[0, [1, 3]], torch.ones(2, 2, dtype=torch.float64))  # exact: accuracy = a count over a count, all correct
    assert torch.isnan(got.acc[0, [0, 2]]).all()
    got.save(tmp_path / "c.safetensors")
    back = ClassifierProbes.load(tmp_path / "c.safetensors")
    assert torch.equal(back.acc.nan_to_num(-1), got.acc.nan_to_num(-1)) and back.positions == (1, 3)  # exact: save/load round trip


def test_classifier_input_errors():
    with pytest.raises(ValueError, match="board features"):
        board_classes(torch.tensor([0.0, 0.5]))
    with pytest.raises(ValueError, match="resid must be"):
        fit_classifier(torch.zeros(2, 3, 4), torch.zeros(3, 4, 1))
    with pytest.raises(ValueError, match="features must be"):
        fit_classifier(torch.zeros(1, 10, 3, 2), torch.zeros(10, 4, 1))


# ---------------------------------------------------------------------------------------------------- report statistics


def _hand_data(direct_useless=(-1.0, 0.0, 1.0)):
    """2 blocks, positions 1..3, 4 squares. Ridge r: useful = 0.8 + 0.1·layer + 0.01·pos, useless = 0.5 − 0.05·j;
    the gap grows with layer and position. Legal-move accuracy 0.99: a world model by the gates (useful r ≥ 0.8 at
    layer 1). Influence totals chosen per cell (see the test)."""
    probes = []
    for w in ("final", "init"):
        for k in range(3):
            for p in (1, 2, 3):
                useful = [0.8 + 0.1 * k + 0.01 * p] * 4 if w == "final" else [0.1] * 4
                useless = [0.5 - 0.05 * j for j in range(4)] if w == "final" else [0.1] * 4
                for metric in ("r", "acc"):
                    probes.append({"weights": w, "metric": metric, "type": "useful", "layer": k, "pos": p,
                                   "values": useful})
                    probes.append({"weights": w, "metric": metric, "type": "useless", "layer": k, "pos": p,
                                   "values": useless})
                    probes.append({"weights": w, "metric": metric, "type": "all", "layer": k, "pos": p,
                                   "values": [0.5, 0.5, None, 0.5]})
    vals = {("direct", "useful"): [2.0, 3.0, 4.0],
            ("pre_cached", "useful"): [0.0, 0.0, 0.0], ("pre_cached", "useless"): [-4.0, -3.0, -2.0],
            ("direct", "useless"): list(direct_useless),
            ("shared", "useful"): [1.0, 1.0, 4.0], ("shared", "useless"): [0.0, 1.0, 2.0]}
    influence = []
    for (c, t), xs in vals.items():
        for i, x in enumerate(xs):
            influence.append({"layer": 1, "pos": 10 + i, "square": "sq_C3", "type": t, "component": c, "total": x,
                              "n_steps": 5})
    for t in ("useful", "useless"):
        for i in range(3):
            full = sum(vals[(c, t)][i] for c in ("direct", "pre_cached", "shared"))
            influence.append({"layer": 1, "pos": 10 + i, "square": "sq_C3", "type": t, "component": "full",
                              "total": full, "n_steps": 5})
    return {"scale": "hand", "seed": 0, "config": {"n_layer": 2, "steps": 5}, "sites": [[1, 10], [1, 11], [1, 12]],
            "squares": ["sq_C3"], "run": {"legal_acc": 0.99, "first_acc": 1.0, "eval_loss": 2.0},
            "eval_curve": [{"step": 0, "legal_acc": 0.1, "first_acc": 0.2, "eval_loss": 4.0},
                           {"step": 5, "legal_acc": 0.9, "first_acc": 1.0, "eval_loss": 2.0}],
            "train_curve": [{"step": 5, "loss": 2.0}], "probes": probes, "influence": influence,
            "influence_sgd": [{**r, "total": 0.01 * r["total"]} for r in influence],  # the SGD direction, same signs
            "curves": [{"step": 5, "type": "useful", "component": "direct", "mean_cumulative": 2.0}],
            "sanity": [{"layer": 1, "pos": 10, "square": "sq_C3", "R0_minus_RT_eval": 1.0, "adam_full": 1.5}],
            "timings": {"train": 10.0, "attribution": 50.0}}


def test_influence_claims_without_a_replay_name_it_as_their_reason():
    """A run made with --no-replays (no influence rows, no exact account): claims (ii)-(iv) are not testable with one
    failing check, the missing replay, and no unit counts or balance; claim (i) does not depend on it. With the
    replay's rows the unit counts come back and the replay check is gone."""
    bare = summarize({**_hand_data(), "influence": [], "curves": [], "sanity": []})
    claims = {c["id"]: c for c in bare["claims"]}
    for cid in ("ii", "iii", "iv"):
        names = [p["name"] for p in claims[cid]["preconditions"]]
        failing = [p["name"] for p in claims[cid]["preconditions"] if not p["ok"]]
        assert claims[cid]["verdict"] == NOT_TESTABLE and claims[cid]["measured"] == "no tracked replay", cid
        assert failing == ["a tracked replay of the run (rerun without --no-replays to add it)"], cid
        assert not any("units of" in n or "balance" in n for n in names), cid
    assert claims["i"]["verdict"] != NOT_TESTABLE
    replayed = {c["id"]: c for c in summarize(_hand_data())["claims"]}
    names = [p["name"] for p in replayed["ii"]["preconditions"]]
    assert any("units of" in n for n in names) and not any("tracked replay" in n for n in names)


def test_report_statistics_on_hand_made_data(tmp_path):
    s = summarize(_hand_data())
    t975_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom
    d = s["influence"]["direct/useful"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(3.0) and d["sd"] == pytest.approx(1.0)
    assert d["lo"] == pytest.approx(3.0 - t975_2 / math.sqrt(3)) and d["hi"] == pytest.approx(3.0 + t975_2 / math.sqrt(3))
    assert s["influence"]["full/useful"]["mean"] == pytest.approx(3.0 + 0.0 + 2.0)
    assert s["influence"]["direct/useful"]["paper"] == [2.85, 12.38]
    # gap at layer k (final): useful − useless = 0.3 + 0.1k + 0.02 (mean over pos 1..3) + 0.05 j, per square j
    g1 = next(g for g in s["gap_by_layer"] if g["metric"] == "r" and g["weights"] == "final" and g["layer"] == 1)
    assert g1["n"] == 4 and g1["mean"] == pytest.approx(0.3 + 0.1 + 0.02 + 0.05 * 1.5)
    sl = s["gap_slopes"]["r/final"]
    assert sl["per_layer"]["mean"] == pytest.approx(0.1) and sl["per_move"]["mean"] == pytest.approx(0.01)
    g0 = next(g for g in s["gap_by_layer"] if g["metric"] == "r" and g["weights"] == "init" and g["layer"] == 2)
    assert g0["mean"] == pytest.approx(0.0)
    # 'all' ignores the null square
    pa = next(r for r in s["probe_by_layer"] if r["metric"] == "r" and r["type"] == "all" and r["layer"] == 0)
    assert pa["n"] == 3 and pa["mean"] == pytest.approx(0.5)
    assert s["step_times"] == {"train_s_per_step": 2.0, "tracked_s_per_step": 10.0, "train_includes": "evaluations"}

    verdicts = {c["id"]: c["verdict"] for c in s["claims"]}
    # (i) positive at layers 1, 2, slopes constant across squares (sd 0 → CI collapses to the mean) > 0
    assert verdicts["i"] == "reproduced"
    # useful [2,3,4]: CI lower bound > 0; useless direct [-1,0,1]: CI ±2.48 straddles the margin ±0.25·|mean full
    # on useless squares| = ±0.25·|(−5 − 2 + 1)/3| = ±0.5, so inconclusive (it contains 0, which no longer suffices)
    assert verdicts["ii"] == "inconclusive"
    assert verdicts["iii"] == "not reproduced"  # useless pre-caching [-4,-3,-2]: CI upper bound < 0
    assert verdicts["iv"] == "inconclusive"  # useful shared [1,1,4] CI contains 0

    (tmp_path / "data.json").write_text(json.dumps(_hand_data()))
    md = write_report(tmp_path)
    text = md.read_text()
    assert "| direct |" in text and "[2.85, 12.38]" in text and "NOT the paper's setting" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [c["verdict"] for c in summary["claims"]] == ["reproduced", "inconclusive", "not reproduced", "inconclusive"]
    # hand-worked: useless direct [-0.1, 0, 0.1], CI ±0.248 inside ±0.5 (full useless: −4.1, −2, 0.1, mean −2):
    # reproduced; [8.5, 9, 9.5] (CI 9 ± 1.24; full useless 4.5, 7, 9.5, mean 7: margin ±1.75) lies wholly outside:
    # not reproduced, its split well-posed (useless means: κ = (9 + 3 + 1) / 7 = 1.86 ≤ 2); [3, 3.5, 4] (full mean
    # 1.5: κ = (3.5 + 3 + 1) / 1.5 = 5) cancels: ill-posed
    verdict = {d: {c["id"]: c["verdict"] for c in summarize(_hand_data(d))["claims"]}["ii"]
               for d in ((-0.1, 0.0, 0.1), (8.5, 9.0, 9.5), (3.0, 3.5, 4.0))}
    assert verdict == {(-0.1, 0.0, 0.1): "reproduced", (8.5, 9.0, 9.5): "not reproduced",
                       (3.0, 3.5, 4.0): "ill-posed under Adam"}


def test_influence_claims_need_the_first_order_balance():
    # Σ full influence 10.5 against 1.0 removed on held-out data: the decomposition does not account for training,
    # so the influence claims (ii–iv) are not testable; the probe claim (i) does not rest on it
    data = {**_hand_data(), "sanity": [{"layer": 1, "pos": 10, "square": "sq_C3", "R0_minus_RT_eval": 1.0,
                                        "adam_full": 10.5}]}
    s = summarize(data)
    assert [c["verdict"] for c in s["claims"]] == ["reproduced"] + [NOT_TESTABLE] * 3
    check = next(p for p in s["claims"][1]["preconditions"] if p["name"].startswith("first-order balance"))
    assert check["value"] == pytest.approx(10.5) and not check["ok"]


def _with_centred(data):
    """``data`` as written since R_c exists: whole-batch ("all") rows of two squares at site (1, 10) for both
    mismatches, centred rows of the useful type, and the held-out records per square x mismatch."""
    paper = {"direct": (2.0, 4.0), "pre_cached": (1.0, 1.0), "shared": (-1.0, 1.0)}
    centred = {"direct": (0.5, 1.5), "pre_cached": (-0.2, -0.4), "shared": (0.1, 0.3)}
    out = {**data, "influence": list(data["influence"]), "influence_centred": [], "mismatch": []}
    for key, vals in (("influence", paper), ("influence_centred", centred)):
        for j, sq in enumerate(("sq_C3", "sq_D4")):
            parts = {**{c: v[j] for c, v in vals.items()}, "full": sum(v[j] for v in vals.values())}
            out[key] += [{"layer": 1, "pos": 10, "square": sq, "type": "all", "component": c, "total": x,
                          "n_steps": 5} for c, x in parts.items()]
    out["influence_centred"] += [{"layer": 1, "pos": 10, "square": "sq_C3", "type": "useful", "component": c,
                                  "total": x, "n_steps": 5}
                                 for c, x in {"direct": 0.25, "pre_cached": 0.0, "shared": 0.5, "full": 0.75}.items()]
    for m, r0, removed in (("paper", (5.0, 6.0), (3.0, 5.0)), ("centred", (1.0, 2.4), (0.5, 1.5))):
        out["mismatch"] += [{"layer": 1, "pos": 10, "square": sq, "mismatch": m, "R0_eval": r0[j],
                             "R0_minus_RT_eval": removed[j], "offset_share_R0": (0.8, 0.6)[j]}
                            for j, sq in enumerate(("sq_C3", "sq_D4"))]
    return out


def test_report_mismatch_table_on_hand_made_data(tmp_path):
    s = summarize(_with_centred(_hand_data()))
    assert s["centred_recorded"] is True
    rows = {(r["layer"], r["pos"], r["type"]): r for r in s["mismatch_by_site"]}
    assert set(rows) == {(1, p, t) for p in (10, 11, 12) for t in ("useful", "useless")} | {(1, 10, "all")}
    a = rows[1, 10, "all"]  # means over the two squares
    expect = {"paper_direct": 3.0, "paper_pre_cached": 1.0, "paper_shared": 0.0, "paper_full": 4.0,
              "paper_removed": 4.0, "centred_direct": 1.0, "centred_pre_cached": -0.3, "centred_shared": 0.2,
              "centred_full": 0.9, "centred_removed": 1.0, "offset_share": 0.7}
    assert a == pytest.approx({"layer": 1, "pos": 10, "type": "all", **expect})
    u = rows[1, 10, "useful"]  # per-type risks: no held-out numbers
    assert (u["paper_direct"], u["paper_full"], u["centred_direct"], u["centred_full"]) == (2.0, 3.0, 0.25, 0.75)
    assert u["offset_share"] is None and u["paper_removed"] is None and u["centred_removed"] is None
    assert rows[1, 11, "useful"]["centred_direct"] is None
    # the figures and claims stay on the paper's R
    assert s["influence"]["direct/useful"] == summarize(_hand_data())["influence"]["direct/useful"]
    (tmp_path / "data.json").write_text(json.dumps(_with_centred(_hand_data())))
    text = write_report(tmp_path).read_text()
    assert "## The paper's mismatch R and the centred R_c" in text and "docs/experiments/toy.md" in text
    assert "| 1 | 10 | all | 0.7 | 1 / -0.3 / 0.2 | 0.9 → 1 | 3 / 1 / 0 | 4 → 4 |" in text
    assert "| 1 | 10 | useful | n/a | 0.25 / 0 / 0.5 | 0.75 → n/a | 2 / 0 / 1 | 3 → n/a |" in text
    assert "not recorded in this run" not in text


def test_report_mismatch_table_on_data_before_centred(tmp_path):
    old = {**_hand_data(), "sanity": [{"layer": 1, "pos": 10, "square": "sq_C3", "R0_minus_RT_eval": 3.0,
                                       "adam_full": 2.0}]}  # no influence_centred, no mismatch records
    s = summarize(old)
    assert s["centred_recorded"] is False
    a = next(r for r in s["mismatch_by_site"] if r["type"] == "all")  # from the sanity rows: the paper's R only
    assert a["paper_removed"] == 3.0 and a["offset_share"] is None and a["centred_removed"] is None
    (tmp_path / "data.json").write_text(json.dumps(old))
    text = write_report(tmp_path).read_text()
    assert "R_c: not recorded in this run" in text
    nr = "not recorded in this run"
    assert f"| 1 | 10 | useful | n/a | {nr} | {nr} | 2 / 0 / 1 | 3 → n/a |" in text


def test_report_missing_data_is_not_testable(tmp_path):
    s = summarize({"scale": "empty"})
    assert [c["verdict"] for c in s["claims"]] == ["not testable at this scale"] * 4
    assert {"name": "at least 2 squares", "value": 0, "ok": False, "short": "squares", "need": "≥ 2"} in \
        s["claims"][0]["preconditions"]
    with pytest.raises(FileNotFoundError, match="missing file"):
        write_report(tmp_path)
    (tmp_path / "data.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupted JSON"):
        write_report(tmp_path)


def test_slope():
    assert slope([1, 2, 3], [1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert slope([1, 2, 3], [1.0, None, 5.0]) == pytest.approx(2.0)
    assert slope([1], [1.0]) is None


@pytest.mark.parametrize("legal,shift,failing", [(0.96, 0.0, [0]), (0.99, -0.2, [1]), (0.73, -0.6, [0, 1])])
def test_no_othello_claim_is_decided_without_a_world_model(legal, shift, failing):
    # the hand data has one (legal 0.99, useful r 0.91 at layer 1); lower the accuracy or the useful squares' r
    data = _hand_data()
    data["run"] = {**data["run"], "legal_acc": legal}
    data["probes"] = [{**p, "values": [v + shift for v in p["values"]]} if p["type"] == "useful" and
                      p["weights"] == "final" and p["metric"] == "r" else p for p in data["probes"]]
    s = summarize(data)
    assert [c["verdict"] for c in s["claims"]] == [NOT_TESTABLE] * 4
    for c in s["claims"]:
        gates = [p for p in c["preconditions"] if p["name"].startswith("a world model")]
        assert [i for i, g in enumerate(gates) if not g["ok"]] == failing
    assert gates[0]["value"] == legal and gates[1]["value"] == pytest.approx(0.8 + 0.1 + 0.02 + shift)


# ---------------------------------------------------------------------------------------------------- fragility verdicts


def _fragility_record(gap_a, gap_b, myopic_legal=0.99):
    """A fragility record with the middle-layer probe_acc intervals ``gap_a`` (vanilla) and ``gap_b`` (myopic −
    vanilla) as (mean, lo, hi), a myopic model with a world model unless ``myopic_legal`` < 0.97."""
    def comp(regime, g):
        return {"metric": "probe_acc", "layer": "middle", "regime": regime, "mean": g[0], "lo": g[1], "hi": g[2],
                "n": 20, "n_useful": 10, "n_useless": 10, "n_boot": 100}
    return {"t": 27, "t0": 24, "depth": 3, "n_games": 10, "seed": 0, "n_boot": 100, "pairs": {"useful": 10, "useless": 10},
            "mean_differing_stones": {"useful": 2.0, "useless": 1.5}, "rows": {"vanilla": [], "myopic": []},
            "comparisons": [comp("vanilla", gap_a), comp("myopic − vanilla", gap_b)],
            "myopic": {"legal_acc": myopic_legal, "useful_r_by_layer": [{"layer": 1, "mean": 0.85}]}}


def test_fragility_predictions_are_decided_by_their_intervals_and_gated():
    def verdicts(*args, **kw):
        return [c["verdict"] for c in summarize({**_hand_data(), "fragility": _fragility_record(*args, **kw)})
                ["fragility"]["claims"]]

    # the hand data has a world model (legal 0.99, useful r 0.92 at layer 1); so has the myopic record
    assert verdicts((0.1, 0.02, 0.2), (-0.1, -0.2, -0.01)) == ["reproduced", "not reproduced"]
    assert verdicts((0.1, -0.02, 0.2), (0.1, 0.0, 0.2)) == ["inconclusive", "inconclusive"]  # 0 inside or on a bound
    # a myopic model without a world model gates (b) only; a vanilla one without it gates both
    assert verdicts((0.1, 0.02, 0.2), (0.1, 0.05, 0.2), myopic_legal=0.9) == ["reproduced", NOT_TESTABLE]
    data = {**_hand_data(), "fragility": _fragility_record((0.1, 0.02, 0.2), (0.1, 0.05, 0.2))}
    data["run"] = {**data["run"], "legal_acc": 0.5}
    assert [c["verdict"] for c in summarize(data)["fragility"]["claims"]] == [NOT_TESTABLE] * 2
    assert summarize(_hand_data())["fragility"] is None  # before the test: no section


def test_rerendering_judges_the_fragility_predictions_again(tmp_path):
    """A report re-rendered from its summary.json alone judges the fragility predictions again from the stored
    numbers: the same claims as the first rendering, and a stale stored verdict does not survive."""
    out = tmp_path / "report"
    out.mkdir()
    (out / "data.json").write_text(json.dumps({**_hand_data(), "fragility": _fragility_record(
        (0.1, 0.02, 0.2), (-0.1, -0.2, -0.01))}))
    write_report(out)
    first = json.loads((out / "summary.json").read_text())["fragility"]["claims"]
    assert [c["verdict"] for c in first] == ["reproduced", "not reproduced"]
    assert "holds here: NTP-useless differences" in (out / "report.md").read_text()  # the acronym kept
    (out / "data.json").unlink()
    stale = json.loads((out / "summary.json").read_text())
    for c in stale["fragility"]["claims"]:
        c["verdict"] = "stale"
    (out / "summary.json").write_text(json.dumps(stale))
    write_report(out)
    assert json.loads((out / "summary.json").read_text())["fragility"]["claims"] == first


def test_report_links_the_pilots_and_lists_the_settings(tmp_path):
    data = {**_hand_data(), "pilots": "pilots", "readout": 16,
            "config": {"n_layer": 2, "steps": 5, "batch_size": 4, "n_train": 10, "warmup": 2, "decay": "cosine",
                       "final_lr_frac": 0.1},
            "timings": {"train": 10.0, "fragility": 3.0, "cpu_s": {"fragility": 2.0}}}
    (tmp_path / "data.json").write_text(json.dumps(data))
    md = write_report(tmp_path).read_text()
    assert "[README.md](pilots/README.md) · [pilots.png](pilots/pilots.png) · [curves.json](pilots/curves.json)" in md
    html = (tmp_path / "report.html").read_text()
    assert '<a href="pilots/README.md">README.md</a>' in html
    assert "| lr schedule | 2-step linear warmup, cosine decay to 0.1 × lr | constant | yes |" in md
    assert "| games seen (steps × batch) | 20 (2 × the training set) | 5120000 | yes |" in md
    assert "| readout (exact account) | the first 16 eval games | none (each step's own batch) | yes |" in md
    # CPU time: recorded for the fragility test only, the training's wall time only (timed before CPU times)
    assert "| fragility test | 2 | 3 |" in md and "| training (vanilla) | not recorded | 10 |" in md
    assert f"{2.0 / 3600:.3g} core-hours over the stages with a CPU record" in md
    assert "no record for: training (myopic)" in md
    before = {p: p.read_bytes() for p in (tmp_path / "report.md", tmp_path / "summary.json")}
    write_report(tmp_path)  # byte-stable re-render
    assert all(p.read_bytes() == b for p, b in before.items())


def test_bootstrap_and_wilson_intervals():
    from ntpflow.stats import bootstrap_ci, wilson_ci

    # Wilson by hand: k = 8 of n = 10, z = 1.96: centre (0.8 + z²/20)/(1 + z²/10), half z·sqrt(0.016 + z²/400)/(1 + z²/10)
    z = 1.959963984540054
    c, h = (0.8 + z * z / 20) / (1 + z * z / 10), z * math.sqrt(0.016 + z * z / 400) / (1 + z * z / 10)
    w = wilson_ci(8, 10)
    assert (w["mean"], w["n"]) == (0.8, 10) and w["lo"] == pytest.approx(c - h) and w["hi"] == pytest.approx(c + h)
    assert wilson_ci(0, 0)["lo"] is None and wilson_ci(0, 5)["lo"] == 0.0
    # constant samples: every resample gives the same statistic, exactly
    a, b = np.full(7, 2.0), np.full(5, 0.5)
    const = bootstrap_ci(lambda i, j: a[i].mean() - b[j].mean(), [7, 5], n_boot=50)
    assert const["mean"] == const["lo"] == const["hi"] == 1.5
    # a normal sample of 400: the percentile interval of the mean is close to the t-interval (within 15%)
    x = np.random.default_rng(0).normal(size=400)
    bs = bootstrap_ci(lambda i: x[i].mean(), [400], n_boot=2000, seed=1)
    t = stats(x.tolist())
    assert bs["mean"] == pytest.approx(t["mean"]) and (bs["hi"] - bs["lo"]) == pytest.approx(t["hi"] - t["lo"], rel=0.15)
    assert bootstrap_ci(lambda i: x[i].mean(), [1])["lo"] is None
    assert bootstrap_ci(lambda i: x[i].mean(), [400], seed=3) == bootstrap_ci(lambda i: x[i].mean(), [400], seed=3)
