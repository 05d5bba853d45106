"""Claims as data: rules decide from the same parameters their text states; preconditions gate the verdict; the
renderer writes every claim and figure caption to md, html and summary.json."""

import json

import pytest

from ntpflow.experiments.claim_registry import RESIDUAL_LIMIT, ROW_LIMIT, account_check, row_balance_check
from ntpflow.experiments.claims import (
    EXACT,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    NOT_TESTABLE,
    PAPERS_READING,
    REPRODUCED,
    Claim,
    Rule,
    at_least,
    every,
    interval_above,
    verdict_text,
    within_margin,
)
from ntpflow.experiments.figure_style import ci_label, clip
from ntpflow.experiments.render import read_blocks, to_html, to_markdown, write_documents
from ntpflow.replay.summary import residual_lines, residual_share


def ci(lo, hi):
    return {"mean": None if lo is None else (lo + hi) / 2, "lo": lo, "hi": hi}


WHEN = {"fixed": "2026-12-03", "against": "none"}


@pytest.mark.parametrize(("lo", "hi", "threshold", "verdict"), [
    (0.1, 0.5, 0.0, REPRODUCED), (-0.5, -0.1, 0.0, NOT_REPRODUCED), (-0.1, 0.2, 0.0, INCONCLUSIVE),
    (1.2, 1.7, 1.0, REPRODUCED), (0.9, 1.7, 1.0, INCONCLUSIVE), (0.2, 0.8, 1.0, NOT_REPRODUCED),
    (None, None, 0.0, INCONCLUSIVE), (0.0, 0.3, 0.0, INCONCLUSIVE),  # a bound on the threshold decides nothing
])
def test_interval_above_decides_what_its_text_says(lo, hi, threshold, verdict):
    rule = interval_above("the gap", "gap", threshold, **WHEN)
    assert rule.decide({"gap": ci(lo, hi)}) == verdict
    t = f"{threshold:g}"
    assert f"lower bound > {t}" in rule.text and f"upper bound < {t}" in rule.text and "the gap" in rule.text


def test_mean_beyond_the_threshold_with_an_interval_spanning_it_is_inconclusive():
    rule = interval_above("Δ", "d", **WHEN)
    assert rule.decide({"d": {"mean": 0.5, "lo": -0.1, "hi": 1.1}}) == INCONCLUSIVE
    assert rule.decide({"d": {"mean": -0.5, "lo": -1.1, "hi": 0.1}}) == INCONCLUSIVE  # not "not reproduced"
    assert rule.decide({"d": {"mean": -0.5, "lo": None, "hi": None}}) == INCONCLUSIVE  # a mean alone decides nothing


@pytest.mark.parametrize(("lo", "hi", "verdict"), [
    (-0.02, 0.04, REPRODUCED), (-0.3, 0.05, REPRODUCED),  # inside the one-sided margin (the bound on it counts)
    (0.06, 0.2, NOT_REPRODUCED), (0.051, 0.3, NOT_REPRODUCED),  # wholly above it
    (-0.02, 0.08, INCONCLUSIVE), (0.04, 0.2, INCONCLUSIVE),  # straddling it
    (-0.5, 0.5, INCONCLUSIVE),  # contains 0 but is wide: noise cannot reproduce a "never" claim
    (0.05, 0.2, INCONCLUSIVE), (None, None, INCONCLUSIVE),
])
def test_one_sided_equivalence_margin(lo, hi, verdict):
    rule = within_margin("myopic's gain", "g", 0.05, why="hand-worked", **WHEN)
    assert rule.decide({"g": ci(lo, hi)}) == verdict
    assert "at most 0.05" in rule.text and "lower bound > 0.05" in rule.text and "hand-worked" in rule.text


@pytest.mark.parametrize(("lo", "hi", "margin", "verdict"), [
    (-0.4, 0.4, 0.5, REPRODUCED), (-0.5, 0.5, 0.5, REPRODUCED), (0.6, 2.0, 0.5, NOT_REPRODUCED),
    (-2.0, -0.6, 0.5, NOT_REPRODUCED), (-0.4, 0.7, 0.5, INCONCLUSIVE), (-0.7, 0.4, 0.5, INCONCLUSIVE),
    (-2.5, 2.5, 0.5, INCONCLUSIVE), (-0.1, 0.1, None, INCONCLUSIVE),  # no margin measured
])
def test_two_sided_equivalence_margin_read_from_the_numbers(lo, hi, margin, verdict):
    rule = within_margin("direct", "d", "m", lower="-m", margin_text="0.25 × |full|", why="hand-worked", **WHEN)
    numbers = {"d": ci(lo, hi), **({} if margin is None else {"m": margin, "-m": -margin})}
    assert rule.decide(numbers) == verdict
    assert "within ±0.25 × |full|" in rule.text


def test_every_combines_as_stated():
    rule = every(interval_above("useful", "u", **WHEN), within_margin("useless", "s", 0.5, lower=-0.5, why="w", **WHEN))
    assert rule.decide({"u": ci(1, 2), "s": ci(-0.4, 0.4)}) == REPRODUCED
    assert rule.decide({"u": ci(1, 2), "s": ci(0.6, 1)}) == NOT_REPRODUCED  # useless outside the margin
    assert rule.decide({"u": ci(1, 2), "s": ci(-1, 1)}) == INCONCLUSIVE  # contains 0, but wider than the margin
    assert rule.decide({"u": ci(-1, 2), "s": ci(-0.1, 0.1)}) == INCONCLUSIVE
    assert rule.decide({"u": ci(-2, -1), "s": ci(-0.1, 0.1)}) == NOT_REPRODUCED
    assert rule.decide({}) == INCONCLUSIVE
    assert rule.text.startswith("(1) Reproduced if the 95% CI of useful")
    assert "(2) Equivalence test: reproduced if the whole 95% CI of useless lies inside [-0.5, 0.5]" in rule.text
    assert rule.fixed == "2026-12-03" and rule.against == "none"


def test_a_rule_records_when_it_was_fixed_and_against_what():
    with pytest.raises(ValueError, match="fixed and against"):
        Rule("text", lambda n: REPRODUCED, "", "none")
    with pytest.raises(ValueError, match="fixed and against"):
        Rule("text", lambda n: REPRODUCED, "2026-12-03", "")
    with pytest.raises(TypeError):
        interval_above("Δ", "d")  # no default record
    d = Claim("a", "Δ > 0", "0.76", interval_above("Δ", "d", **WHEN), {"d": ci(0.1, 0.2)}).to_dict()
    assert (d["fixed"], d["against"]) == ("2026-12-03", "none")


def test_exact_account_check_and_paper_reading_marks():
    rows = [{"residual": 0.004, "R0_eval": 2.0}, {"residual": -0.009, "R0_eval": 1.0}, {"R0_eval": 5.0}]
    share = residual_share(rows)  # hand-worked: max(0.002, 0.009); the row without a residual is not counted
    assert share == {"worst": pytest.approx(0.009), "n": 2, "zero_R0": 0}
    assert residual_share([{"R0_eval": 1.0}]) is None  # the paper's reading: no row has a residual
    assert account_check(share, "rows").ok and account_check(share, "rows").value == 0.009
    assert RESIDUAL_LIMIT == 0.01
    over = account_check(residual_share([{"residual": 0.0101, "R0_eval": 1.0}]), "rows")
    assert not over.ok and over.fixed and over.against
    zero = account_check(residual_share([{"residual": 1e-9, "R0_eval": 0.0}]), "rows")  # nothing to remove, yet a residual
    assert not zero.ok
    assert not account_check(None, "rows").ok


def test_residual_lines_decide_as_the_claims_do():
    """The log line of `attribute` agrees with the claims' check: a feature constant on the readout (R_H(θ_0) = 0, no
    residual) is set aside, not an infinite ratio; R_H(θ_0) = 0 with a residual fails."""
    row = {"mismatch": "paper"}
    lines = residual_lines([{**row, "residual": 0.004, "R0_eval": 2.0}, {**row, "residual": 0.0, "R0_eval": 0.0}])
    assert lines == ["exact account, paper: largest |residual| / R_H(θ_0) 2.00e-03 PASS (≤ 0.01); "
                     "1 rows with R_H(θ_0) = 0 and no residual, nothing to split"]
    (line,) = residual_lines([{**row, "residual": 1e-9, "R0_eval": 0.0}])
    assert line.startswith("exact account, paper: largest |residual| / R_H(θ_0) n/a FAIL") and "but a residual" in line
    (line,) = residual_lines([{"mismatch": "centred", "residual": -0.03, "R0_eval": 1.0}, {"mismatch": "paper"}])
    assert line == "exact account, centred: largest |residual| / R_H(θ_0) 3.00e-02 FAIL (≤ 0.01)"
    claim = {"verdict": REPRODUCED, "reading": PAPERS_READING}
    assert verdict_text(claim) == "reproduced (paper's reading)"
    assert verdict_text({**claim, "reading": EXACT}) == verdict_text({"verdict": REPRODUCED}) == "reproduced"
    assert verdict_text({**claim, "verdict": NOT_TESTABLE}) == NOT_TESTABLE


def test_a_failed_precondition_makes_the_claim_not_testable_whatever_the_numbers():
    rule = interval_above("Δ", "d", **WHEN)
    numbers = {"d": ci(0.1, 0.2)}
    ok = Claim("a", "Δ > 0", "0.76", rule, numbers, "Δ = 0.15", (at_least("seeds", 3, 2),))
    low = Claim("a", "Δ > 0", "0.76", rule, numbers, "Δ = 0.15", (at_least("seeds", 1, 2), at_least("units", 9, 2)))
    missing = Claim("a", "Δ > 0", "0.76", rule, numbers, "", (at_least("seeds", None, 2),))
    assert ok.verdict == REPRODUCED
    assert low.verdict == NOT_TESTABLE and missing.verdict == NOT_TESTABLE
    d = low.to_dict()
    assert d["preconditions"] == [{"name": "at least 2 seeds", "value": 1, "ok": False, "short": "seeds", "need": "≥ 2"},
                                  {"name": "at least 2 units", "value": 9, "ok": True, "short": "units", "need": "≥ 2"}]
    assert d["claim"] == "Δ > 0" and d["paper"] == "0.76" and d["rule"] == rule.text and d["verdict"] == NOT_TESTABLE
    json.dumps(d, allow_nan=False)  # the form written to summary.json


def test_renderer_writes_claims_captions_and_figures(tmp_path):
    claim = Claim("i", "the gap is positive", "[2.85, 12.38]", interval_above("the gap", "g", **WHEN), {"g": ci(0.2, 0.4)},
                  "0.3 [0.2, 0.4]", (at_least("squares", 16, 2),), context="majority")
    png = b"\x89PNG fake bytes"
    blocks = [("h1", "Title"), ("claims", [claim.to_dict()], False), ("fig", "gap", "The gap by layer, n = 16."),
              ("links", "Full report:", [("toy/report.html", "toy/report.html")])]
    write_documents(tmp_path, blocks, {"gap": png}, {"scale": "small"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["claims"] == [claim.to_dict()] and summary["scale"] == "small"
    assert summary["figures"] == [{"name": "gap", "caption": "The gap by layer, n = 16."}]
    html = (tmp_path / "report.html").read_text()
    assert html == to_html(blocks, {"gap": png})
    assert '<table id="claims">' in html and "[2.85, 12.38]" in html and 'class="v-reproduced"' in html
    assert "<b>Figure 1.</b> The gap by layer, n = 16." in html
    assert '<a href="toy/report.html">toy/report.html</a>' in html
    assert "at least 2 squares: 16" in html and "[majority]" in html
    md = (tmp_path / "report.md").read_text()
    assert md == to_markdown(blocks)
    assert "![gap](figures/gap.png)" in md and "*Figure 1. The gap by layer, n = 16.*" in md
    assert "Full report: [toy/report.html](toy/report.html)" in md


def test_template_markup_reads_as_blocks():
    text = """# Title

A paragraph
on two lines.

## Claims

[claims]

![gap] The gap
by layer.

| a | b | #t
["x | y", "two\\nlines"]
"""
    assert read_blocks(text, ["c"]) == [("h1", "Title"), ("p", "A paragraph on two lines."), ("h2", "Claims"),
                                        ("claims", ["c"], False), ("fig", "gap", "The gap by layer."),
                                        ("table", ["a", "b"], [["x | y", "two\nlines"]], "t")]


def test_templates_ship_with_the_package():
    from fnmatch import fnmatch
    from importlib.resources import files
    from pathlib import Path

    import tomllib

    from ntpflow.experiments.report_all import EXPERIMENTS

    folder = files("ntpflow.experiments") / "templates"
    names = {f"{name}.md.j2" for name in EXPERIMENTS} | {"_macros.j2"}
    assert names <= {p.name for p in folder.iterdir()}
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["ntpflow.experiments"]
    assert all(any(fnmatch(f"templates/{n}", g) for g in globs) for n in names)


def test_style_words_and_clipping():
    assert ci_label(3, "seeds") == "95% t-CI over n = 3 seeds"
    assert ci_label(1, "seeds") == "1 seed: no CI"
    assert clip(-1.3, 1.2, (-1, 1)) == (-1, 1) and clip(0.2, 0.4, (-1, 1)) == (0.2, 0.4)
    assert clip(None, 2.0, (0, 1)) == (None, 1) and clip(-5, 5, None) == (-5, 5)


def test_welch_and_sd_ratio_intervals_against_scipy():
    """The report statistics agree with scipy's own tests (an independent implementation)."""
    import numpy as np
    from scipy import stats as st

    from ntpflow.stats import sd_ratio_ci, welch_ci

    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 2.0, 12), rng.normal(0.0, 0.5, 7)
    w = welch_ci(list(a) + [float("nan")], b)  # non-finite values are dropped
    assert w["n_a"] == 12 and w["diff"] == pytest.approx(a.mean() - b.mean())
    assert w["p"] == pytest.approx(st.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    ci = st.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (w["lo"], w["hi"]) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
    r = sd_ratio_ci(a, b)
    f = a.var(ddof=1) / b.var(ddof=1)
    assert r["ratio"] == pytest.approx(f ** 0.5)
    # the interval holds exactly the ratios not rejected by the two-sided F test at 5%
    for bound in (r["lo"], r["hi"]):
        stat = f / bound ** 2
        assert min(st.f.cdf(stat, 11, 6), st.f.sf(stat, 11, 6)) == pytest.approx(0.025, rel=1e-6)
    assert sd_ratio_ci(a[:2], b)["ratio"] is None


@pytest.mark.parametrize(("rows", "ok"), [
    ([(2.0, 1.0)], True), ([(0.5, 1.0)], True),  # a factor 2 either way: the boundary, inside
    ([(2.2, 1.0)], False), ([(0.45, 1.0)], False), ([(-1.0, 1.0)], False),
    ([(2.0, 0.0), (0.0, 2.0)], False),  # the sums balance (2 = 2), the rows do not: each row's change is elsewhere
    ([(1.0, 4.0), (1.0, -2.0)], False),  # the same: first order says both rose by 1; one rose by 4, one fell by 2
    ([(1.1, 1.0), (-0.5, -0.6), (3.0, 2.5)], True),
])
def test_row_balance_is_a_factor_2_per_row_and_sees_cancellation(rows, ok):
    check = row_balance_check(rows, "hand-worked rows")
    # hand-worked: 2 Σ|F − D| / Σ(|F| + |D|); a factor 2 on one row gives 2 · 1/3 = 2/3
    expected = 2 * sum(abs(f - d) for f, d in rows) / sum(abs(f) + abs(d) for f, d in rows)
    assert check.value == pytest.approx(round(expected, 3)) and check.ok == ok
    assert ROW_LIMIT == pytest.approx(2 / 3)
    assert row_balance_check([], "none").value == "no data" and not row_balance_check([], "none").ok


def test_one_palette_per_meaning():
    """No colour means two things: the palettes of figure_style are disjoint (formal/other latents are drawn in the
    code/stories domain colours on purpose) and the baseline grey and the failure red belong to no palette."""
    from ntpflow.experiments import figure_style as fs

    seen = {}
    for meaning, palette in fs.PALETTES.items():
        for key, color in palette.items():
            if meaning == "group" and key in ("formal", "other", "baseline"):
                continue
            assert color.upper() not in seen, f"{meaning}/{key} reuses {seen.get(color.upper())}'s colour"
            seen[color.upper()] = f"{meaning}/{key}"
    assert fs.BASELINE.upper() not in seen and fs.FAIL_COLOR.upper() not in seen
    assert fs.GROUP_COLORS["formal"] == fs.DOMAIN_COLORS["code"] and fs.GROUP_COLORS["baseline"] == fs.BASELINE
    from ntpflow.experiments import othello_report, stories_report, toy_report

    assert toy_report.REGIME_COLORS == fs.REGIME_COLORS and othello_report.TYPE_COLORS == fs.TYPE_COLORS
    assert all(stories_report.REGIME_COLORS[r] == fs.REGIME_COLORS[r] for r in stories_report.REGIMES)


@pytest.mark.parametrize("shared", [False, True])
def test_account_note_covers_no_data(shared):
    """The account note sits above every data point of its panel (and of a panel sharing its y axis), however tall the
    note: the highest bar's top, in display units, lies below the note's lower edge; without the note the bar would
    reach into its corner."""
    from ntpflow.experiments import figure_style as fs

    with fs.style():
        fig, axes = fs.figure(6.0, 2.5, 1, 2, sharey=shared)
        bars = [ax.bar([0, 1, 2], [9.0, 1.0, -2.0 * (i + 1)], label="b") for i, ax in enumerate(axes[0])]
        note_ax = axes[0][1] if shared else axes[0][0]
        fs.account_note(note_ax, "a long account note\nover\nseveral\nlines", ok=True)
        fs.finish(fig, "t")
        fig.draw_without_rendering()
        note = next(t for t in note_ax.texts if t.get_gid() == fs.NOTE_GID)
        note_bottom = note.get_window_extent().y0
        for i, ax in enumerate(axes[0]):
            if shared or ax is note_ax:
                assert bars[i][0].get_window_extent().y1 < note_bottom
        # the whole data range stays visible
        lo, hi = note_ax.get_ylim()
        assert lo <= -2.0 * (1 + shared) and hi > 9.0
