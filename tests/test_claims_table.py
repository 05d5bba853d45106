"""The claims table of every report type stays short, and the rules list below it keeps every word the old "rule
(preconditions)" cell held: on each committed report (docs/results) and on an Othello report with the fragility
predictions, in both report.md and report.html, with anchors that the links of the table reach."""

import html
import json
import re
from pathlib import Path

import pytest
from test_reproduce_othello import _fragility_record, _hand_data

from ntpflow.experiments import llm_report, othello_report, stories_report, toy_report
from ntpflow.experiments.render import CLAIM_HEADER, CLAIMS_ID, stored_summary, to_html, to_markdown

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
COMMITTED = {"toy-medium": toy_report, "toy-medium-cond": toy_report,
             "toy-medium-cond-exact": toy_report, "toy-paper": toy_report, "othello-small": othello_report,
             "othello-medium": othello_report, "othello-medium-6x6": othello_report,
             "stories-small": stories_report, "llm-small": llm_report}
# A failing precondition's short form names the quantity in a few words, its value and its threshold ("legal acc
# 0.7298 (needs ≥ 0.97)": 31 characters; the longest, the exact account's, 55). 60 characters a failing check is one
# line of a narrow column; "all met" needs far less. The old cell held 400-1500 characters.
PER_FAILING, ALL_MET = 60, 10


def old_cell_pieces(c: dict) -> list[str]:
    """The pieces of a claim's old "rule (preconditions)" cell, as render.py wrote it before the rules list (the
    oracle, spelled out here): the rule, its fixed record, each precondition's name and value (and "(fails)") and
    its own fixed record."""
    pieces = [c["rule"]]
    if c.get("fixed"):
        pieces.append(f"Rule fixed {c['fixed']}, against {c['against']}.")
    for p in c.get("preconditions") or []:
        pieces.append(f"{p['name']}: {p['value']}{'' if p['ok'] else ' (fails)'}")
        if p.get("fixed"):
            pieces.append(f"[fixed {p['fixed']}, against {p['against']}]")
    return pieces


def documents():
    """(name, blocks) of every committed report type, rendered from its stored summary, and of an Othello report
    with the fragility predictions (hand-made data); without figures (none drawn)."""
    def text_only(blocks):
        return [b for b in blocks if b[0] != "fig"]

    for name, module in COMMITTED.items():
        yield name, text_only(module._document(stored_summary(RESULTS / name), {}))
    data = {**_hand_data(), "fragility": _fragility_record((0.1, 0.02, 0.2), (0.1, 0.05, 0.2), myopic_legal=0.9)}
    yield "othello-fragility", text_only(othello_report._document(othello_report.summarize(data), {}))


def claims_tables(blocks):
    """[(html_id, claims)] of the claims blocks."""
    return [(b[3] if len(b) > 3 else CLAIMS_ID, b[1]) for b in blocks if b[0] == "claims"]


def table_rows(md: str, n_before: int) -> list[list[str]]:
    """The rows of the (n_before + 1)-th claims table of report.md, split into cells (escaped "|" kept)."""
    head = "| " + " | ".join(CLAIM_HEADER) + " |"
    start = [i for i, line in enumerate(md.splitlines()) if line == head][n_before]
    rows = []
    for line in md.splitlines()[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


@pytest.mark.parametrize("name, blocks", list(documents()), ids=lambda x: x if isinstance(x, str) else "")
def test_claims_table_is_short_and_the_rules_keep_every_word(name, blocks):
    md, page = to_markdown(blocks), to_html(blocks, {})
    tables = claims_tables(blocks)
    assert tables and all(claims for _, claims in tables)
    if name == "othello-fragility":
        assert [tid for tid, _ in tables] == [CLAIMS_ID, "fragility-claims"]
        assert '<table id="fragility-claims">' in page
    for k, (_, claims) in enumerate(tables):
        rows = table_rows(md, k)
        assert len(rows) == len(claims)
        for c, row in zip(claims, rows):
            for piece in old_cell_pieces(c):  # nothing lost, in either document
                assert piece in md, (name, piece)
                assert html.escape(piece) in page, (name, piece)
                assert all(piece not in cell for cell in row) or piece in c["measured"], (name, piece)
            cell = row[-1]
            text, link = re.fullmatch(r"(.*) · \[rule\]\(#(rule-[\w-]+)\)", cell).groups()
            failing = [p for p in c["preconditions"] if not p["ok"]]
            assert len(text) <= PER_FAILING * max(1, len(failing)) and (failing or len(text) <= ALL_MET), cell
            assert (text == "all met") == (not failing and bool(c["preconditions"]))
            for p in failing:  # each failing one named with its value (and threshold where it has one)
                assert str(p["value"]) in text and p.get("need", "") in text
            # the link reaches the claim's rule in both documents, and the rule follows its anchor
            assert md.count(f'<a id="{link}"></a>') == 1 and page.count(f'id="{link}"') == 1
            after = md[md.index(f'<a id="{link}"></a>'):]
            assert after.index(c["rule"]) < after.index("\n- ") if "\n- " in after else c["rule"] in after
            assert f'<a href="#{link}">rule</a>' in page


def test_markdown_anchors_render_as_link_targets():
    """The rules' anchors survive a CommonMark renderer (raw HTML kept, as GitHub keeps an <a id>): every href of
    the table has its target element."""
    markdown_it = pytest.importorskip("markdown_it")
    for _, blocks in documents():
        rendered = markdown_it.MarkdownIt("commonmark").enable("table").render(to_markdown(blocks))
        hrefs = set(re.findall(r'href="#(rule-[\w-]+)"', rendered))
        ids = re.findall(r'<a id="(rule-[\w-]+)"></a>', rendered)
        assert hrefs and hrefs == set(ids) and len(ids) == len(set(ids))


def test_only_the_main_claims_table_goes_into_summary(tmp_path):
    """summary.json's claims are the report's claims, not the fragility predictions (they sit in its fragility
    record), so the combined report lists each experiment's claims once."""
    data = {**_hand_data(), "fragility": _fragility_record((0.1, 0.02, 0.2), (0.1, 0.05, 0.2))}
    (tmp_path / "data.json").write_text(json.dumps(data))
    othello_report.write_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [c["id"] for c in summary["claims"]] == ["i", "ii", "iii", "iv"]
    assert [c["id"] for c in summary["fragility"]["claims"]] == ["fragility a", "fragility b"]
