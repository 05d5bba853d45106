"""The toy-task report (ntpflow.experiments.toy_report) on synthetic data.json files with known verdicts."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from _util import all_numbers

from ntpflow.experiments.report_kit import stats, t_quantile_975
from ntpflow.experiments.toy_report import (
    CLAIM_A,
    CLAIM_B,
    CLAIM_C,
    SIGN,
    summarize,
    write_report,
)

REGIMES = ("vanilla", "myopic", "untied", "myopic-untied")
FEATURES = {"majority": [f"is_majority_<{v}>" for v in range(3)], "cond_majority": [f"prev_is_<{v}>" for v in range(3)]}
TRACKED = {"majority": FEATURES["majority"], "cond_majority": ["prev_is_<0>"]}
SITES = [[1, 3], [1, 5], [1, 12]]
FIGURES = ("probe_majority", "probe_cond_majority", "task_success", "influence_curves", "influence_bars")
WIGGLE = (-1.0, 0.0, 1.0, 0.5, -0.5)  # zero-mean over 3 seeds: means are exactly the constructed values

# gains of probe r over init at input positions, per task and regime
GAIN_OK = {"majority": {"vanilla": 0.5, "myopic": 0.3, "untied": 0.35, "myopic-untied": 0.1},
           "cond_majority": {"vanilla": 0.6, "myopic": 0.0, "untied": 0.5, "myopic-untied": 0.0}}
GAIN_BAD = {"majority": {"vanilla": 0.3, "myopic": 0.5, "untied": 0.35, "myopic-untied": 0.1},
            "cond_majority": {"vanilla": 0.6, "myopic": 0.4, "untied": 0.5, "myopic-untied": 0.0}}
# integrated influence at NTP-useless sites in vanilla, per component
INFL_OK = {"direct": 0.0, "pre_cached": 0.3, "shared": 0.2}
INFL_BAD = {"direct": 0.8, "pre_cached": 0.1, "shared": 0.1}


def wiggle(seed: int, ri: int, scale: float) -> float:
    """Seed noise; differs per regime index ``ri`` so paired differences have a non-zero spread."""
    return scale * (1 + ri) * WIGGLE[seed % len(WIGGLE)]


def make_data(seeds=(0, 1, 2), tasks=("majority", "cond_majority"), gains=GAIN_OK, infl=INFL_OK, steps=4) -> dict:
    runs, probes, influence, curves = [], [], [], []
    for task in tasks:
        for ri, regime in enumerate(REGIMES):
            for seed in seeds:
                key = {"task": task, "regime": regime, "seed": seed}
                runs.append({**key, "eval_loss": 0.8 + wiggle(seed, ri, 0.01), "legal_acc": 0.9 - 0.1 * ri
                             + wiggle(seed, ri, 0.01), "first_acc": 0.6 - 0.1 * ri + wiggle(seed, ri, 0.01)})
                for weights in ("final", "init"):
                    for layer in range(3):
                        for pos in range(1, 21):
                            for fi, f in enumerate(FEATURES[task]):
                                r = 0.2 + 0.02 * layer + 0.01 * fi
                                if weights == "final" and pos >= 10:
                                    r = 0.95
                                elif weights == "final" and layer >= 1:
                                    r += gains[task][regime] + wiggle(seed, ri, 0.01)
                                if task == "cond_majority" and pos == 1:
                                    r = None  # the previous token is BOS: constant feature
                                if (task, seed, pos, fi, weights) == ("majority", 1, 3, 1, "final"):
                                    r = None  # a null r inside the claim window
                                probes.append({**key, "weights": weights, "layer": layer, "pos": pos, "feature": f,
                                               "r": r, "useful": pos >= 10})
                totals = dict(infl)
                if regime.startswith("myopic"):
                    totals["pre_cached"] = 0.0
                for layer, pos in SITES:
                    for f in TRACKED[task]:
                        useful = pos >= 10
                        comp = {c: (1.0 if useful else v + wiggle(seed, ri + j, 0.01))
                                for j, (c, v) in enumerate(totals.items())}
                        comp["full"] = sum(comp.values())
                        for c, v in comp.items():
                            influence.append({**key, "layer": layer, "pos": pos, "feature": f, "component": c,
                                              "total": v, "useful": useful})
                            for s in range(1, steps + 1):
                                curves.append({**key, "step": s, "layer": layer, "pos": pos, "feature": f,
                                               "component": c, "cumulative": v * s / steps})
    return {"scale": "synthetic", "seeds": list(seeds), "sites": SITES,
            "train": {"steps": steps, "d_model": 32, "n_head": 2, "n_train": 1024, "n_eval": 256},
            "tracked": {t: TRACKED[t] for t in tasks}, "runs": runs, "probes": probes, "influence": influence,
            "curves": curves}


def write_data(d: Path, data: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "data.json").write_text(json.dumps(data))
    return d


def verdicts(summary: dict) -> dict:
    return {(c["claim"], c["task"]): c["verdict"] for c in summary["claims"]}


def read_outputs(d: Path) -> dict:
    return {p: (d / p).read_bytes() for p in ("summary.json", "report.md", "report.html",
                                              *(f"figures/{f}.{e}" for f in FIGURES for e in ("png", "svg")))}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = write_data(tmp_path_factory.mktemp("good"), make_data())
    assert write_report(d) == d / "report.md"
    return d


def test_t_quantile_and_stats():
    for df, q in ((1, 12.706204736174694), (2, 4.302652729749462), (3, 3.1824463052837078),
                  (9, 2.262157162798205), (30, 2.0422724563012378), (1000, 1.9623390808264083)):
        assert t_quantile_975(df) == pytest.approx(q, abs=1e-9)
    s = stats([1.0, 2.0, None, float("nan"), 3.0])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["sd"] == 1.0
    assert s["lo"] == pytest.approx(2.0 - 4.302652729749462 / math.sqrt(3))
    assert stats([5.0]) == {"mean": 5.0, "sd": None, "lo": None, "hi": None, "n": 1}
    assert stats([None])["n"] == 0


def test_files_and_html(good):
    for p in read_outputs(good):
        assert (good / p).stat().st_size > 0, p
    assert not list(good.rglob("*.tmp")), "temporary files left behind"
    html = (good / "report.html").read_text()
    assert 'id="claims"' in html
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<(link|script)\b", html)
    srcs = re.findall(r'<img\b[^>]*\bsrc="([^"]*)"', html)
    assert len(srcs) == len(FIGURES)
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    md = (good / "report.md").read_text()
    for f in FIGURES:
        assert f"figures/{f}.png" in md
    for text in (md, html):
        assert text.count(SIGN) >= 3  # intro, curves caption, bars caption
        assert "paper" in text and "differs" in text
    claims_table = html.split('id="claims"')[1].split("</table>")[0]
    assert claims_table.count("<tr>") == 1 + 4  # header + a, b, c for two tasks


def test_summary_numbers_and_verdicts(good):
    s = json.loads((good / "summary.json").read_text())
    assert all(math.isfinite(x) for x in all_numbers(s))
    assert s["n_seeds"] == 3
    v = verdicts(s)
    assert v == {(CLAIM_A, "majority"): "reproduced", (CLAIM_B, "cond_majority"): "reproduced",
                 (CLAIM_C, "majority"): "reproduced", (CLAIM_C, "cond_majority"): "reproduced"}
    for c in s["claims"]:
        assert set(c) == {"claim", "task", "measured", "verdict", "rule"} and c["rule"] and c["measured"]
    pg = s["probe_gain"]["majority"]["per_regime"]
    for regime, g in GAIN_OK["majority"].items():
        assert pg[regime]["gain"]["mean"] == pytest.approx(g, abs=1e-9)
        assert pg[regime]["gain"]["n"] == 3 and pg[regime]["gain"]["lo"] < g < pg[regime]["gain"]["hi"]
    d = s["probe_gain"]["majority"]["vs_vanilla"]["myopic"]
    assert d["mean"] == pytest.approx(-0.2, abs=1e-9) and d["hi"] < 0
    van = s["influence"]["majority"]["per_regime"]["vanilla"]
    for c, x in INFL_OK.items():  # useful sites (total 1.0) are excluded
        assert van[c]["mean"] == pytest.approx(x, abs=1e-9)
    assert van["full"]["mean"] == pytest.approx(sum(INFL_OK.values()), abs=1e-9)
    ts = s["task_success"]["majority"]["untied"]["legal_acc"]
    assert ts["mean"] == pytest.approx(0.7) and ts["n"] == 3
    last = [r for r in s["influence_curves"] if r["task"] == "majority" and r["regime"] == "vanilla"
            and r["component"] == "shared"][-1]
    assert last["step"] == 4 and last["mean"] == pytest.approx(INFL_OK["shared"], abs=1e-9)
    assert s["useful_positions"]["majority"] == list(range(10, 21))


def test_regenerate_is_identical(good):
    before = read_outputs(good)
    write_report(good)
    after = read_outputs(good)
    for p in ("summary.json", "report.md", "report.html"):
        assert before[p] == after[p], p
    assert before == after  # figures too (same matplotlib)


@pytest.mark.parametrize("gains, infl, expected", [
    (GAIN_BAD, INFL_BAD, ("not reproduced",) * 4),
    ({"majority": {**GAIN_OK["majority"], "untied": 0.5}, "cond_majority": {**GAIN_OK["cond_majority"],
                                                                            "vanilla": 0.0}},
     {"direct": 0.2, "pre_cached": 0.3, "shared": -0.05}, ("inconclusive",) * 4),
])
def test_other_verdicts(gains, infl, expected):
    s = summarize(make_data(gains=gains, infl=infl))
    assert tuple(c["verdict"] for c in s["claims"]) == expected, [c["measured"] for c in s["claims"]]


def test_one_seed_and_missing_task(tmp_path):
    d = write_data(tmp_path, make_data(seeds=(0,), tasks=("majority",)))
    write_report(d)
    s = json.loads((d / "summary.json").read_text())
    assert s["n_seeds"] == 1 and s["tasks"] == ["majority"]
    assert all(math.isfinite(x) for x in all_numbers(s))
    assert {c["verdict"] for c in s["claims"]} == {"inconclusive"}
    g = s["probe_gain"]["majority"]["per_regime"]["vanilla"]["gain"]
    assert g["n"] == 1 and g["lo"] is None and g["hi"] is None
    assert not (d / "figures" / "probe_cond_majority.png").exists()
    assert (d / "figures" / "probe_majority.png").exists()
    md = (d / "report.md").read_text()
    assert "(n=1)" in md and "probe_cond_majority: not drawn" in md
    html = (d / "report.html").read_text()
    assert 'id="claims"' in html and "http://" not in html and "https://" not in html


def test_missing_data_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.json"):
        write_report(tmp_path)


def test_smoke_data_if_present(tmp_path):
    src = Path("/tmp/toysmoke/data.json")
    if not src.exists():
        pytest.skip("no smoke run at /tmp/toysmoke")
    shutil.copy(src, tmp_path / "data.json")
    write_report(tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert all(math.isfinite(x) for x in all_numbers(s))
    assert len(s["claims"]) >= 3 and 'id="claims"' in (tmp_path / "report.html").read_text()
