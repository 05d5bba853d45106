"""The toy-task report (ntpflow.experiments.toy_report) on synthetic data.json files with known verdicts."""

import json
import math
import re
import statistics

import pytest
from _util import all_numbers

from ntpflow.experiments.claims import NOT_TESTABLE
from ntpflow.experiments.figure_style import SIGN
from ntpflow.experiments.toy_report import FIGURES, summarize, write_report
from ntpflow.stats import r_stats

REGIMES = ("vanilla", "myopic", "untied", "myopic-untied")
FEATURES = {"majority": [f"is_majority_<{v}>" for v in range(3)], "cond_majority": [f"prev_is_<{v}>" for v in range(3)]}
TRACKED = {"majority": FEATURES["majority"], "cond_majority": ["prev_is_<0>"]}
SITES = [[1, 3], [1, 5], [1, 12]]
OPTIMUM = {"majority": 0.555, "cond_majority": 0.685}
WIGGLE = (-1.0, 0.0, 1.0, 0.5, -0.5)  # zero-mean over 3 seeds: means are exactly the constructed values

# gains of probe r over init at input positions (init r 0.2), per task and regime
GAIN_OK = {"majority": {"vanilla": 0.5, "myopic": 0.3, "untied": 0.35, "myopic-untied": 0.1},
           "cond_majority": {"vanilla": 0.75, "myopic": 0.0, "untied": 0.5, "myopic-untied": 0.0}}
GAIN_BAD = {"majority": {"vanilla": 0.3, "myopic": 0.5, "untied": 0.35, "myopic-untied": 0.1},
            "cond_majority": {"vanilla": 0.75, "myopic": 0.4, "untied": 0.5, "myopic-untied": 0.0}}
# integrated influence at NTP-useless sites in vanilla, per mismatch and component
INFL_OK = {"direct": 0.0, "pre_cached": 0.3, "shared": 0.2}
INFL_BAD = {"direct": 0.8, "pre_cached": 0.1, "shared": 0.1}


def wiggle(seed: int, ri: int, scale: float) -> float:
    """Seed noise; differs per regime index ``ri`` so paired differences have a non-zero spread."""
    return scale * (1 + ri) * WIGGLE[seed % len(WIGGLE)]


def make_data(seeds=(0, 1, 2), tasks=("majority", "cond_majority"), gains=GAIN_OK, centred=INFL_OK, paper=INFL_BAD,
              first_acc=1.0, steps=4, overshoot=1.0, row_skew=0.0, probe_noise=0.004, residual=None,
              sgd=0.01) -> dict:
    """Synthetic data.json records; the replays' SGD direction is ``sgd`` × the Adam totals (None: not kept, a
    negative factor: every component of the opposite sign)."""
    runs, probes, influence, curves, mismatch, eval_curves = [], [], [], [], [], []
    for task in tasks:
        for ri, regime in enumerate(REGIMES):
            for seed in seeds:
                key = {"task": task, "regime": regime, "seed": seed}
                gap = 0.002 + wiggle(seed, 0, 0.001)
                acc = first_acc if regime == "vanilla" else 0.9
                runs.append({**key, "eval_loss": OPTIMUM[task] + gap, "optimal_loss": OPTIMUM[task],
                             "loss_gap": gap, "first_acc": acc, "legal_acc": acc, "steps": steps})
                eval_curves.append({**key, "step": 0, "loss_gap": 0.5, "first_acc": 0.6})
                eval_curves.append({**key, "step": steps, "loss_gap": gap, "first_acc": acc})
                for weights in ("final", "init"):
                    for layer in range(3):
                        for pos in range(1, 21):
                            for fi, f in enumerate(FEATURES[task]):
                                r = 0.2
                                if weights == "final" and layer >= 1:
                                    r += gains[task][regime] + wiggle(seed, ri, probe_noise)
                                probes.append({**key, "weights": weights, "layer": layer, "pos": pos, "feature": f,
                                               "r": r, "useful": pos >= 10})
                if regime != "vanilla":
                    continue
                for m, infl in (("centred", centred), ("paper", paper)):
                    for layer, pos in SITES:
                        for f in TRACKED[task]:
                            useful = pos >= 10
                            comp = {c: (1.0 if useful else v + wiggle(seed, j, 0.01))
                                    for j, (c, v) in enumerate(infl.items())}
                            comp["full"] = sum(comp.values())
                            site = {"layer": layer, "pos": pos, "feature": f, "mismatch": m}
                            for c, v in comp.items():
                                influence.append({**key, **site, "component": c, "total": v, "useful": useful})
                                if sgd is not None:
                                    influence.append({**key, **site, "component": c, "total": sgd * v,
                                                      "useful": useful, "optimizer": "sgd"})
                                for s in range(1, steps + 1):
                                    curves.append({**key, **site, "step": s, "component": c,
                                                   "cumulative": v * s / steps})
                            mismatch.append({**key, **site, "useful": useful, "R0_eval": 2.0 if m == "paper" else 0.5,
                                             # R_c removed: the full influence / overshoot (R: 0.4)
                                             "R0_minus_RT_eval": 0.4 if m == "paper" else comp["full"] / overshoot
                                             # row_skew: features 0 and 1 share the change unevenly, same sum
                                             * (1 + row_skew * ([1, -1, 0][TRACKED[task].index(f)]
                                                                if len(TRACKED[task]) == 3 else 0)),
                                             "offset_share_R0": 0.7 + 0.02 * seed + 0.01 * TRACKED[task].index(f)})
                            if residual is not None:  # the exact account: one row (seed 0, the first useless site
                                # and feature) has |residual| = residual · R_H(θ_0), every other row 1e-6 of it
                                one = (seed, layer, pos, f) == (seeds[0], *SITES[0], TRACKED[task][0])
                                mismatch[-1]["residual"] = (residual if one else 1e-6) * mismatch[-1]["R0_eval"]
    return {"scale": "synthetic", "seeds": list(seeds), "sites": SITES, "tracked_seeds": list(seeds),
            "train": {"d_model": 32, "n_train": 1024, "n_eval": 256}, "task_train": {t: {"steps": steps} for t in tasks},
            "tracked": {t: TRACKED[t] for t in tasks}, "runs": runs, "probes": probes, "influence": influence,
            "curves": curves, "mismatch": mismatch, "eval_curves": eval_curves}


def write_data(d, data: dict):
    d.mkdir(parents=True, exist_ok=True)
    (d / "data.json").write_text(json.dumps(data))
    return d


def verdicts(summary: dict) -> dict:
    return {(c["id"], c["context"]): c["verdict"] for c in summary["claims"]}


def outputs(d) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != "data.json"}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = write_data(tmp_path_factory.mktemp("good"), make_data())
    assert write_report(d) == d / "report.md"
    return d


def test_r_stats_stay_in_range_and_match_fisher_z():
    s = r_stats([0.99, 0.999, 0.95])
    assert -1 < s["lo"] < s["mean"] < s["hi"] < 1
    z = [math.atanh(v) for v in (0.99, 0.999, 0.95)]
    assert s["mean"] == pytest.approx(math.tanh(sum(z) / 3), rel=1e-12)
    assert r_stats([None])["n"] == 0


def test_files_and_html(good):
    files = outputs(good)
    for f in FIGURES:
        assert f"figures/{f}.png" in files and f"figures/{f}.svg" in files, f
    assert not list(good.rglob("*.tmp")), "temporary files left behind"
    html = (good / "report.html").read_text()
    assert 'id="claims"' in html and "http://" not in html and "https://" not in html
    srcs = re.findall(r'<img\b[^>]*\bsrc="([^"]*)"', html)
    assert len(srcs) == len(FIGURES) and all(s.startswith("data:image/png;base64,") for s in srcs)
    md = (good / "report.md").read_text()
    assert SIGN in md and "not testable at this scale" in md  # the rules explain it even when nothing is
    claims_table = html.split('id="claims"')[1].split("</table>")[0]
    assert claims_table.count("<tr>") == 1 + 4  # header + a, b, c for two tasks


def test_summary_numbers_and_verdicts(good):
    s = json.loads((good / "summary.json").read_text())
    assert all(math.isfinite(x) for x in all_numbers(s))
    assert verdicts(s) == {("a", "majority"): "reproduced", ("b", "cond_majority"): "reproduced",
                           ("c", "majority"): "reproduced", ("c", "cond_majority"): "reproduced"}
    for c in s["claims"]:
        assert c["rule"] and c["measured"] and c["preconditions"] and all(p["ok"] for p in c["preconditions"])
    pg = s["probe_gain"]["majority"]["per_regime"]
    for regime, g in GAIN_OK["majority"].items():
        assert pg[regime]["gain"]["mean"] == pytest.approx(g, abs=1e-9)
        assert pg[regime]["init"]["mean"] == pytest.approx(0.2, abs=1e-9)  # the baseline is reported
    inf = s["influence"]["majority"]
    for c, x in INFL_OK.items():  # useful sites (total 1.0) are excluded; the two mismatches kept apart
        assert inf["centred"][c]["mean"] == pytest.approx(x, abs=1e-9)
        assert inf["paper"][c]["mean"] == pytest.approx(INFL_BAD[c], abs=1e-9)
    assert s["gates"]["majority"]["max_loss_gap"] == pytest.approx(0.003)
    bal = {(r["task"], r["mismatch"], r["where"]): r for r in s["balance"]}
    assert bal["majority", "centred", "useless"]["influence"] == pytest.approx(sum(INFL_OK.values()), abs=1e-9)
    assert bal["majority", "paper", "useless"]["removed"] == pytest.approx(0.4)
    for r in s["offset_share"]:  # mean over the features of each seed, then a t-interval over the 3 seeds
        feats = len(TRACKED[r["task"]])
        assert r["n"] == 3 and r["mean"] == pytest.approx(0.72 + 0.01 * (feats - 1) / 2, abs=1e-12)
        per_seed = [0.7 + 0.02 * sd + 0.01 * (feats - 1) / 2 for sd in range(3)]
        half = 4.302652729911275 * statistics.stdev(per_seed) / math.sqrt(3)  # t(0.975, 2)
        # ntpflow.stats's t quantile is a series approximation, good to ~1e-11 here
        assert (r["lo"], r["hi"]) == pytest.approx((r["mean"] - half, r["mean"] + half), abs=1e-9)


def test_regenerate_is_identical(good):
    before = outputs(good)
    write_report(good)
    assert outputs(good) == before


def test_bad_numbers_give_not_reproduced():
    s = summarize(make_data(gains=GAIN_BAD, centred=INFL_BAD, paper=INFL_OK))
    assert set(verdicts(s).values()) == {"not reproduced"}


def test_an_unbalanced_first_order_makes_c_not_testable():
    # Σ full influence on R_c 3× the R_c removed at the useless sites (means over seeds, hand-worked: 3.0)
    s = summarize(make_data(overshoot=3.0))
    v = verdicts(s)
    assert v[("c", "majority")] == v[("c", "cond_majority")] == NOT_TESTABLE
    assert v[("a", "majority")] == v[("b", "cond_majority")] == "reproduced"
    c = next(c for c in s["claims"] if (c["id"], c["context"]) == ("c", "majority"))
    check = next(p for p in c["preconditions"] if p["name"].startswith("first-order balance"))
    assert check["value"] == pytest.approx(3.0) and not check["ok"]
    assert verdicts(summarize(make_data(overshoot=0.6)))[("c", "majority")] == "reproduced"  # within 2×, either way


def test_rows_that_cancel_make_c_not_testable():
    # at each useless site, feature 0 removed 2.5× and feature 1 −0.5× its full influence: the sums balance (factor
    # 1), the rows do not (hand-worked: 2 · 3F / (3F + 2.5F + 0.5F + F) = 0.857 > 2/3). Conditioned majority has one
    # feature per site, so nothing to cancel.
    s = summarize(make_data(row_skew=1.5))
    c = next(c for c in s["claims"] if (c["id"], c["context"]) == ("c", "majority"))
    checks = {p["name"].split(":")[0]: p for p in c["preconditions"]}
    assert checks["first-order balance"]["ok"] and checks["first-order balance"]["value"] == pytest.approx(1.0)
    assert checks["first-order balance row by row"]["value"] == pytest.approx(0.857, abs=2e-3)
    assert verdicts(s)[("c", "majority")] == NOT_TESTABLE and verdicts(s)[("c", "cond_majority")] == "reproduced"
    assert verdicts(summarize(make_data(row_skew=0.5)))[("c", "majority")] == "reproduced"  # 0.4 ≤ 2/3


def test_the_paper_mismatch_does_not_decide():
    # centred says "direct builds it", the paper's R (offset-dominated) says the opposite: the verdict follows R_c
    s = summarize(make_data(centred=INFL_BAD, paper=INFL_OK))
    assert verdicts(s)[("c", "majority")] == "not reproduced"


def test_gates_make_claims_not_testable():
    # vanilla misses first-output accuracy on one seed: every claim that rests on vanilla is not testable
    data = make_data()
    for r in data["runs"]:
        if (r["task"], r["regime"], r["seed"]) == ("cond_majority", "vanilla", 1):
            r["first_acc"] = 0.76
    v = verdicts(summarize(data))
    assert v[("b", "cond_majority")] == v[("c", "cond_majority")] == NOT_TESTABLE
    assert v[("a", "majority")] == v[("c", "majority")] == "reproduced"
    # vanilla never learns prev_is_<0> (final r 0.55 < 0.9): "myopic never learns it" is not testable
    v = verdicts(summarize(make_data(gains={**GAIN_OK, "cond_majority": {**GAIN_OK["cond_majority"],
                                                                         "vanilla": 0.35}})))
    assert v[("b", "cond_majority")] == NOT_TESTABLE


def test_learning_curve_gives_the_step_from_which_every_seed_passes():
    # hand-worked: (step, loss gap, first-output accuracy) per vanilla seed; a seed passes from the first evaluation
    # after which every evaluation passes both gates (gap <= 0.01, accuracy >= 0.99)
    data = make_data(tasks=("cond_majority",))
    evals = {0: [(0, 0.5, 0.6), (100, 0.008, 0.995), (200, 0.005, 0.999)],    # passes from 100
             1: [(0, 0.5, 0.6), (100, 0.008, 0.995), (200, 0.02, 0.999), (300, 0.009, 0.99)],  # relapse: from 300
             2: [(0, 0.5, 0.6), (100, 0.05, 1.0), (200, -0.001, 0.992), (300, 0.0, 1.0)]}  # negative gap passes
    data["eval_curves"] = [{"task": "cond_majority", "regime": g, "seed": sd, "step": st, "loss_gap": gap,
                            "first_acc": acc} for g in ("vanilla", "myopic") for sd, ev in evals.items()
                           for st, gap, acc in ev]
    learning = summarize(data)["learning"]["cond_majority"]
    assert learning["pass_from"] == [{"seed": 0, "step": 100}, {"seed": 1, "step": 300}, {"seed": 2, "step": 200}]
    assert learning["all_pass_from"] == 300 and learning["last_step"] == 300
    assert {e["seed"] for e in learning["curves"]} == {0, 1, 2} and len(learning["curves"]) == 11  # vanilla only
    # seed 1 misses the loss gate at its last evaluation: it never passes, and so not every seed does
    data["eval_curves"] = [e for e in data["eval_curves"] if not (e["seed"] == 1 and e["step"] == 300)]
    data["eval_curves"].append({"task": "cond_majority", "regime": "vanilla", "seed": 1, "step": 300,
                                "loss_gap": 0.011, "first_acc": 1.0})
    learning = summarize(data)["learning"]["cond_majority"]
    assert learning["pass_from"][1] == {"seed": 1, "step": None} and learning["all_pass_from"] is None


def test_one_seed_is_not_testable(tmp_path):
    d = write_data(tmp_path, make_data(seeds=(0,), tasks=("majority",)))
    write_report(d)
    s = json.loads((d / "summary.json").read_text())
    assert s["tasks"] == ["majority"] and {c["verdict"] for c in s["claims"]} == {NOT_TESTABLE}
    assert all(math.isfinite(x) for x in all_numbers(s))
    assert not (d / "figures" / "probe_cond_majority.png").exists()


def test_missing_data_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.json"):
        write_report(tmp_path)


def _cond(gain_myopic, noise):
    gains = {**GAIN_OK, "cond_majority": {**GAIN_OK["cond_majority"], "myopic": gain_myopic,
                                          "myopic-untied": gain_myopic}}
    return verdicts(summarize(make_data(tasks=("cond_majority",), gains=gains, probe_noise=noise)))[
        ("b", "cond_majority")]


def test_never_learns_is_an_equivalence_test():
    # myopic gains per seed: g + (1 + ri)·noise·(−1, 0, 1) (ri = 1 myopic, 3 myopic-untied); 95% t-CI half-width
    # 4.303 · (1 + ri)·noise / √3: noise 0.004 → myopic-untied ±0.040, inside the margin 0.05 around gain 0
    assert _cond(0.0, 0.004) == "reproduced"
    # the same mean with noise 0.03: CI ±0.30 contains 0 (the old rule reproduced it) but crosses the margin
    assert _cond(0.0, 0.03) == "inconclusive"
    # the mean beyond the margin (0.08), myopic CI ±0.17 spanning 0: inconclusive, not "not reproduced"
    assert _cond(0.08, 0.035) == "inconclusive"
    # a gain of 0.15 with noise 0.004: CI [0.11, 0.19] lies wholly above the margin
    assert _cond(0.15, 0.004) == "not reproduced"
    claim = next(c for c in summarize(make_data())["claims"] if c["id"] == "b")
    assert claim["fixed"].startswith("2026-11-29") and "2026-12-03" in claim["fixed"] and "none" in claim["against"]


def test_exact_account_decides_influence_claims(tmp_path):
    # every R_c row's |residual| is 1e-6 of its R_H(θ_0) but one: 0.009 passes (≤ 1%), 0.011 fails
    s = summarize(make_data(residual=0.009, overshoot=3.0))  # the paper's balance would fail; it is not asked
    c = next(c for c in s["claims"] if (c["id"], c["context"]) == ("c", "majority"))
    assert c["reading"] == "exact account" and c["verdict"] == "reproduced"
    names = [p["name"] for p in c["preconditions"]]
    assert any(n.startswith("exact account") for n in names) and not any("balance" in n for n in names)
    check = next(p for p in c["preconditions"] if p["name"].startswith("exact account"))
    assert check["value"] == pytest.approx(0.009) and check["ok"] and check["fixed"]
    assert s["exact_account"]["majority"]["n"] == 3 * 2 * 3  # seeds × useless sites × features (R_c)
    bad = summarize(make_data(residual=0.011))
    assert verdicts(bad)[("c", "majority")] == NOT_TESTABLE
    # without residuals the claim is the paper's reading: its verdict is printed marked as such
    d = write_data(tmp_path, make_data())
    write_report(d)
    s = json.loads((d / "summary.json").read_text())
    assert {c["reading"] for c in s["claims"] if c["id"] == "c"} == {"paper's reading"}
    md = (d / "report.md").read_text()
    assert "| reproduced (paper's reading) |" in md and "Rules were fixed before the numbers were seen" not in md
    assert "against the overshoots read at θ_t" in md  # the balance rule's record
    assert "a first-order sum that overshoots" in md and "fixed readout set" not in md  # the balance says how it reads
    exact = write_data(tmp_path / "exact", make_data(residual=0.009))
    write_report(exact)
    md = (exact / "report.md").read_text()
    assert "on the fixed readout set" in md and "a first-order sum that overshoots" not in md


def test_a_split_that_cancels_or_flips_is_ill_posed():
    """The meaning checks of claim c (per seed, means over the useless sites × features): κ above 2 (direct +3 and
    shared −2.5 for a net 0.8 at every useless site: κ = 5.8/0.8 ≈ 7.25) or the SGD direction of the opposite sign
    give "ill-posed under Adam"; without the SGD direction a well-conditioned split is not testable, a cancelling
    one still ill-posed."""
    cancel = {"direct": 3.0, "pre_cached": 0.3, "shared": -2.5}
    for data in (make_data(centred=cancel), make_data(centred=cancel, sgd=None), make_data(sgd=-0.01)):
        s = summarize(data)
        assert verdicts(s)[("c", "majority")] == verdicts(s)[("c", "cond_majority")] == "ill-posed under Adam"
        assert verdicts(s)[("a", "majority")] == "reproduced"
    c = next(c for c in summarize(make_data(centred=cancel))["claims"] if (c["id"], c["context"]) == ("c", "majority"))
    kappa = next(p for p in c["preconditions"] if p["name"].startswith("conditioning"))
    per_seed = [(abs(3.0 + wiggle(sd, 0, 0.01)) + abs(0.3 + wiggle(sd, 1, 0.01)) + abs(-2.5 + wiggle(sd, 2, 0.01)))
                / (0.8 + sum(wiggle(sd, j, 0.01) for j in range(3))) for sd in range(3)]
    assert kappa["value"] == pytest.approx(max(per_seed), rel=1e-3) and not kappa["ok"]
    s = summarize(make_data(sgd=None))
    assert verdicts(s)[("c", "majority")] == NOT_TESTABLE
    signs = next(p for c in s["claims"] if c["id"] == "c" for p in c["preconditions"] if p["name"].startswith("the adam"))
    assert signs["value"] == "not measured"


def test_curves_keep_every_chunk_of_an_account_and_every_stride_of_a_replay():
    """A replay has a row per step: its curve keeps every stride-th step and the last. A run's account has a row
    per chunk (its last step), already few: the curve keeps them all (a stride kept only the last, and the toy
    momentum report drew no curve)."""
    from ntpflow.experiments.formats import curve_steps

    assert curve_steps(range(100), 10) == {0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 99}
    assert curve_steps([29, 59, 89, 99], 15) == {29, 59, 89, 99}
    assert curve_steps([5, 5, 6, 7], 2) == {6, 7}  # consecutive from its first: a replay resumed at step 5
