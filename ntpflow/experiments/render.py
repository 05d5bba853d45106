"""The one renderer of every report: an experiment's template -> a list of blocks (claims, figures, tables, text) ->
report.md, report.html and summary.json.

Each experiment's text (headings, paragraphs, captions, table headers) is a Jinja template,
``templates/<experiment>.md.j2``; :func:`template_blocks` renders it and reads the result as blocks, separated by
blank lines (the lines of a heading, paragraph or caption are joined by spaces):

- ``# text`` / ``## text``: headings; ``![name] caption``: a figure; ``[claims]``: the claims table;
  ``[claims html_id] [JSON list of claim dicts]`` (the ``claims`` filter): another claims table (its own claims);
- ``[links] lead text [text](href) [text](href)``: a paragraph of real links;
- ``| head | head |`` (optionally followed by `` #html_id``), then one JSON list of cells a line (the ``row``
  filter): a table;
- anything else: a paragraph.

Blocks are tuples:

- ``("h1" | "h2" | "p", text)`` or ``("h2", text, html_id)``;
- ``("nav", [(text, href), ...])`` and ``("links", lead_text, [(text, href), ...])``: real links;
- ``("table", header, rows, html_id)``: a column named ``verdict`` is coloured by its value;
- ``("claims", claims, show_experiment)`` or ``("claims", claims, show_experiment, html_id)``: a claims table
  (``claims``: dicts of ``Claim.to_dict()``, with an ``experiment`` key when ``show_experiment``), ``id="claims"``
  unless given: short cells (the claim, the paper's value, ours, the verdict, and the failing preconditions in a few
  words or "all met", linked to the claim's rule), then the rules list (:func:`claim_rules`): per claim, anchored
  ``rule-<claim>``, its rule, when it was fixed and against which data, and every precondition with its value;
- ``("fig", name, caption)``: ``name`` = a figure stem, or ``"<experiment>/<stem>"`` in the combined report.

The HTML is self-contained (PNGs as base64 data URIs, inline CSS). :func:`write_documents` writes all three files
atomically; summary.json gets the report's ``claims`` (those of the tables with ``id="claims"``) and ``figures``
(name + caption) besides the caller's numbers.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from ntpflow.experiments import figure_style
from ntpflow.experiments import formats as fm
from ntpflow.experiments.claims import verdict_text
from ntpflow.files import atomic_write, read_json, stamp_text
from ntpflow.stats import finite

CLAIM_HEADER = ["claim", "paper", "ours", "verdict", "preconditions"]
CLAIMS_ID = "claims"  # the html id of a report's claims table (the one whose claims go into summary.json)
TABLE_HEAD = re.compile(r"\| (.*) \|(?: #([\w-]+))?")  # "| a | b |", optionally " #html_id"
CLAIMS_BLOCK = re.compile(r"\[claims ([\w-]+)\] (\[.*\])")  # the ``claims`` filter's block
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")  # [text](href) in a [links] block
STAMP = "stamp.json"  # in a results folder: files.stamp() of the command that made its numbers


def _environment():
    """The templates' Jinja environment, with the number formats of ``formats`` as filters."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("ntpflow.experiments", "templates"), trim_blocks=True,
                             lstrip_blocks=True, undefined=jinja2.StrictUndefined, autoescape=False,
                             extensions=["jinja2.ext.do"])
    env.filters.update(fmt=fm.fmt, fmt_g=fm.fmt_g, fmt_ci=fm.fmt_ci, fmt_ci_g=lambda s: fm.fmt_ci(s, fm.fmt_g),
                       fmt_interval=fm.fmt_interval, fmt_sigma=fm.fmt_sigma, sites=fm.sites_text, where=fm.select,
                       pick=lambda mapping, keys, default=None: [mapping.get(k, default) for k in keys], repr=repr,
                       claims=lambda cs, tid: f"[claims {tid}] " + json.dumps(list(cs), ensure_ascii=False),
                       row=lambda cells: json.dumps([str(c) for c in cells], ensure_ascii=False),
                       ci3=lambda r, m: fm.fmt_ci({"mean": r.get(m), "lo": r.get(f"{m}_lo"), "hi": r.get(f"{m}_hi"),
                                                   "n": r.get("n_pairs")}),
                       precondition=lambda p: f"{p['name']}: {p['value']}{'' if p['ok'] else ' (fails)'}")
    env.tests["finite"] = finite
    return env


def _block(chunk: str, claims) -> tuple:
    """The block of one chunk of rendered template text (see the module's docstring)."""
    lines = [line.strip() for line in chunk.splitlines()]
    if head := TABLE_HEAD.fullmatch(lines[0]):
        return "table", head[1].split(" | "), [json.loads(line) for line in lines[1:]], head[2]
    text = " ".join(lines)
    if text == "[claims]":
        return "claims", claims, False
    if own := CLAIMS_BLOCK.fullmatch(text):
        return "claims", json.loads(own[2]), False, own[1]
    if text.startswith("[links] "):
        lead, _, _ = text[len("[links] "):].partition(" [")
        return "links", lead, LINK.findall(text)
    if text.startswith("!["):
        name, _, caption = text[2:].partition("] ")
        return "fig", name, caption
    level = len(text) - len(text.lstrip("#"))
    return (f"h{level}", text[level + 1:]) if level else ("p", text)


def read_blocks(text: str, claims=()) -> list[tuple]:
    """The blocks of a rendered template's ``text``; ``[claims]`` becomes the claims table of ``claims`` (dicts of
    ``Claim.to_dict()``)."""
    return [_block(chunk, claims) for chunk in re.split(r"\n\s*\n", text.strip())]


def template_blocks(experiment: str, claims, **context) -> list[tuple]:
    """The blocks of ``templates/<experiment>.md.j2`` rendered with ``context`` (see :func:`read_blocks`)."""
    return read_blocks(_environment().get_template(f"{experiment}.md.j2").render(**context), claims)


def precondition_text(p) -> str:
    """A precondition in full, as the rules list prints it: "name: value (fails) [fixed ..., against ...]"."""
    return (f"{p['name']}: {p['value']}{'' if p['ok'] else ' (fails)'}"
            + (f" [fixed {p['fixed']}, against {p['against']}]" if p.get("fixed") else ""))


def precondition_short(p) -> str:
    """A failing precondition in a few words for the claims table: "legal acc 0.7298 (needs ≥ 0.97)" (its ``short``
    and ``need``; a check without them: "name: value")."""
    value = "n/a" if p["value"] is None else p["value"]
    if not p.get("short"):
        return f"{p['name']}: {value}"
    return f"{p['short']} {value}" + (f" (needs {p['need']})" if p.get("need") else "")


def preconditions_cell(claim) -> str:
    """The claims table's preconditions cell: the failing ones in a few words, else "all met" ("none" without
    any)."""
    pre = claim.get("preconditions") or []
    failing = [p for p in pre if not p["ok"]]
    return "; ".join(precondition_short(p) for p in failing) if failing else "all met" if pre else "none"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def claim_rules(claims, show_experiment: bool) -> list[dict]:
    """Per claim (dicts of ``Claim.to_dict()``): ``anchor`` ("rule-" + experiment, id and context, unique among
    ``claims``), ``label`` ("(c) [majority]", prefixed by the experiment when ``show_experiment``), ``text`` (the rule
    and when it was fixed against which data) and ``preconditions`` (each in full, :func:`precondition_text`)."""
    out, seen = [], set()
    for c in claims:
        who = [c.get("experiment", "")] if show_experiment else []
        anchor = base = "rule-" + (_slug(" ".join([*who, c.get("id", ""), c.get("context", "")])) or "claim")
        n = 1
        while anchor in seen:
            n += 1
            anchor = f"{base}-{n}"
        seen.add(anchor)
        label = " ".join([*who, f"({c['id']})" if c.get("id") else "", f"[{c['context']}]" if c.get("context") else ""])
        record = f" Rule fixed {c['fixed']}, against {c['against']}." if c.get("fixed") else ""
        out.append({"anchor": anchor, "label": " ".join(label.split()) or "claim", "text": c.get("rule", "") + record,
                    "preconditions": [precondition_text(p) for p in c.get("preconditions") or []]})
    return out


def _claim_rows(claims, show_experiment: bool) -> tuple[list[str], list[list]]:
    """The claims table: header and rows; the preconditions cell is ``(text, "rule", "#anchor")``, a link cell."""
    header = (["experiment"] if show_experiment else []) + CLAIM_HEADER
    rows = []
    for c, rule in zip(claims, claim_rules(claims, show_experiment)):
        label = f"({c['id']}) " if c.get("id") else ""
        context = f" [{c['context']}]" if c.get("context") else ""
        row = [f"{label}{c['claim']}{context}", c.get("paper") or "n/a", c.get("measured", ""), verdict_text(c),
               (preconditions_cell(c), "rule", f"#{rule['anchor']}")]
        rows.append(([c.get("experiment", "")] if show_experiment else []) + row)
    return header, rows


RULES_LEAD = ("Rules of the claims above: each claim's decision rule, when it was fixed and against which data, "
              "and every precondition with its measured value.")


def _md_rules(rules) -> str:
    items = []
    for r in rules:
        pre = "".join(f"\n  - {_md_line(p)}" for p in r["preconditions"])
        items.append(f'- <a id="{r["anchor"]}"></a>**{r["label"]}** {_md_line(r["text"])}'
                     + (" Preconditions:" if pre else "") + pre)
    return f"{RULES_LEAD}\n\n" + "\n".join(items)


def _html_rules(rules) -> str:
    e = html.escape
    out = [f"<p>{e(RULES_LEAD)}</p>", '<ul class="rules">']
    for r in rules:
        pre = "".join(f"<li>{e(p)}</li>" for p in r["preconditions"])
        out.append(f'<li id="{e(r["anchor"])}"><b>{e(r["label"])}</b> {e(r["text"])}'
                   + (f" Preconditions:<ul>{pre}</ul>" if pre else "") + "</li>")
    out.append("</ul>")
    return "\n".join(out)


def _md_line(s) -> str:
    return str(s).replace("\n", " ")


def _md_cell(s) -> str:
    """A markdown table cell; ``(text, link_text, href)`` is the text followed by a link."""
    if isinstance(s, tuple):
        text, link, href = s
        return f"{_md_cell(text)} · [{_md_cell(link)}]({href})"
    return str(s).replace("|", "\\|").replace("\n", " ")


def _figure_path(name: str) -> str:
    """``figures/<name>`` for a report's own figure, ``<experiment>/figures/<stem>`` for ``"<experiment>/<stem>"``."""
    folder, _, stem = name.rpartition("/")
    return f"{folder}/figures/{stem}" if folder else f"figures/{stem}"


def _md_table(header, rows) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows])


def to_markdown(blocks) -> str:
    """Markdown of the report blocks."""
    out, nfig = [], 0
    for blk in blocks:
        kind = blk[0]
        if kind in ("h1", "h2"):
            out.append(f"{'#' * int(kind[1])} {blk[1]}")
        elif kind == "p":
            out.append(blk[1])
        elif kind == "table":
            out.append(_md_table(blk[1], blk[2]))
        elif kind == "claims":
            out.append(_md_table(*_claim_rows(blk[1], blk[2])))
            out.append(_md_rules(claim_rules(blk[1], blk[2])))
        elif kind == "nav":
            out.append(" · ".join(f"[{text}]({href})" for text, href in blk[1]))
        elif kind == "links":
            out.append(blk[1] + " " + " · ".join(f"[{text}]({href})" for text, href in blk[2]))
        elif kind == "fig":
            _, name, caption = blk
            nfig += 1
            path = _figure_path(name)
            out.append(f"![{name}]({path}.png)\n\n*Figure {nfig}. {caption}* (vector: [{path}.svg]({path}.svg))")
    return "\n\n".join(out) + "\n"


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1200px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.55em; vertical-align: top; text-align: left; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #444; }
td.v-reproduced { background: #dff0d8; } td.v-not-reproduced { background: #f2dede; }
td.v-inconclusive { background: #fcf8e3; } td.v-not-testable-at-this-scale { background: #e8e8e8; }
ul.rules { font-size: 0.9em; } ul.rules > li { margin-bottom: 0.4em; }
""".strip()


def _html_table(header, rows, tid) -> str:
    e = html.escape
    t = [f'<table id="{e(tid)}">' if tid else "<table>",
         "<thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr></thead>", "<tbody>"]
    for r in rows:
        cells = []
        for h, c in zip(header, r):
            cls = f' class="v-{e(str(c).split(" (")[0].replace(" ", "-"))}"' if h == "verdict" else ""
            text = f'{e(c[0])} · <a href="{e(c[2])}">{e(c[1])}</a>' if isinstance(c, tuple) else e(str(c))
            cells.append(f"<td{cls}>{text}</td>")
        t.append("<tr>" + "".join(cells) + "</tr>")
    t.append("</tbody></table>")
    return "\n".join(t)


def _html_links(items) -> str:
    return " · ".join(f'<a href="{html.escape(href)}">{html.escape(text)}</a>' for text, href in items)


def to_html(blocks, pngs: dict[str, bytes]) -> str:
    """A standalone HTML page of the report blocks, with the figures' PNGs (``pngs``: name -> bytes) inline."""
    e = html.escape
    title = next((blk[1] for blk in blocks if blk[0] == "h1"), "Report")
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{e(title)}</title>",
           f"<style>\n{CSS}\n</style>", "</head>", "<body>"]
    nfig = 0
    for blk in blocks:
        kind = blk[0]
        if kind in ("h1", "h2", "p"):
            anchor = f' id="{e(blk[2])}"' if len(blk) > 2 and blk[2] else ""
            out.append(f"<{kind}{anchor}>{e(blk[1])}</{kind}>")
        elif kind == "nav":
            out.append(f"<nav>{_html_links(blk[1])}</nav>")
        elif kind == "links":
            out.append(f"<p>{e(blk[1])} {_html_links(blk[2])}</p>")
        elif kind == "table":
            out.append(_html_table(blk[1], blk[2], blk[3]))
        elif kind == "claims":
            out.append(_html_table(*_claim_rows(blk[1], blk[2]), blk[3] if len(blk) > 3 else CLAIMS_ID))
            out.append(_html_rules(claim_rules(blk[1], blk[2])))
        elif kind == "fig":
            _, name, caption = blk
            nfig += 1
            data = base64.b64encode(pngs[name]).decode("ascii")
            out.append(f'<figure id="fig-{e(name)}"><img alt="{e(caption)}" src="data:image/png;base64,{data}">'
                       f"<figcaption><b>Figure {nfig}.</b> {e(caption)}</figcaption></figure>")
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"


def figure_list(blocks) -> list[dict]:
    """``[{name, caption}]`` of the figures among ``blocks``, in order."""
    return [{"name": blk[1], "caption": blk[2]} for blk in blocks if blk[0] == "fig"]


def write_documents(out: str | Path, blocks, pngs: dict[str, bytes], summary: dict) -> Path:
    """Write ``out``/report.md, report.html and summary.json (``summary`` + the blocks' ``figures`` and the
    claims of its claims tables with ``id="claims"``) atomically; a figure without PNG bytes in ``pngs`` becomes the line "not drawn".
    The stamp (``files.stamp()``): the summary's own (a re-render keeps it), else ``out``/stamp.json's (written when
    the numbers were made); the report's last line. Returns report.md's path."""
    out = Path(out)
    blocks = [("p", f"Figure {blk[1]}: not drawn (no data for it).") if blk[0] == "fig" and blk[1] not in pngs
              else blk for blk in blocks]
    summary = dict(summary)
    if "stamp" not in summary and (out / STAMP).exists():
        summary["stamp"] = read_json(out / STAMP)
    if summary.get("stamp"):
        blocks = [*blocks, ("p", stamp_text(summary["stamp"]))]
    summary["figures"] = figure_list(blocks)
    tables = [blk[1] for blk in blocks if blk[0] == "claims" and (blk[3] if len(blk) > 3 else CLAIMS_ID) == CLAIMS_ID]
    if tables:
        summary["claims"] = [c for t in tables for c in t]
    atomic_write(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True, allow_nan=False,
                                                  ensure_ascii=False) + "\n")
    atomic_write(out / "report.md", to_markdown(blocks))
    atomic_write(out / "report.html", to_html(blocks, pngs))
    return out / "report.md"


def write_from_data(out_dir: str | Path, summarize, figures: dict, document) -> Path:
    """The report pipeline of an experiment folder: ``summary = summarize(data)`` from ``data.json`` (or, when only
    ``summary.json`` is there, as for the committed results under docs/results, the stored summary itself), the
    ``figures`` (see :func:`draw_figures`), blocks (``document(summary, pngs)``); write summary.json, report.md and
    report.html atomically (``render.write_documents``). Returns report.md's path."""
    out = Path(out_dir)
    summary = canonical(summarize(read_json(out / "data.json"))) if (out / "data.json").exists() or not (
        out / "summary.json").exists() else stored_summary(out)
    pngs = draw_figures(summary, out / "figures", figures)
    return write_documents(out, document(summary, pngs), pngs, summary)


def draw_figures(summary: dict, figdir: Path, figures: dict) -> dict[str, bytes]:
    """Draw each figure of ``figures`` ({name: fn(summary) -> a matplotlib Figure, or None without data}) in the
    report style (``figure_style``) and save it into ``figdir``; returns {name: PNG bytes} of those drawn."""
    figdir.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for name, draw in figures.items():
        with figure_style.style():
            fig = draw(summary)
        if fig is not None:
            pngs[name] = figure_style.save(fig, figdir, name)
    return pngs


def canonical(summary: dict) -> dict:
    """``summary`` as summary.json stores it (keys sorted, strings as keys), so that a report rendered from fresh
    numbers and one re-rendered from its summary.json list their rows in one order, byte for byte."""
    return json.loads(json.dumps(summary, sort_keys=True, allow_nan=False))


def stored_summary(out: Path) -> dict:
    """``out/summary.json`` without what the renderer derives (figures; claims are judged again from the numbers)."""
    summary = read_json(out / "summary.json")
    summary.pop("figures", None)
    return summary


def report_main(module: str, experiment: str, write_report, argv=None) -> None:
    """Command line of a report module (``python -m ntpflow.experiments.<module>``): write the report of the
    experiment's output folder OUT and print the path ``write_report`` returns."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m ntpflow.experiments.{module}",
                                 description=f"Write the {experiment} report from the results in OUT.")
    ap.add_argument("out", help=f"the output folder of the {experiment} experiment")
    print(write_report(ap.parse_args(argv).out))
