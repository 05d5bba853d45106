"""Every experiment in one go, and one self-contained page that gathers their claims and figures.

``run_all(scale, out)`` runs each experiment of :data:`EXPERIMENTS` into ``out/<experiment>`` (each
resumable) and writes its report; ``write_report(out)`` then writes ``out/report.html`` (no network needed to view
it: inline CSS, figures as data URIs), ``out/report.md`` and ``out/summary.json``. The page has the claims table of
all experiments (claim, the paper's value, ours, verdict, rule), one section per experiment linked from the top
with a link to the experiment's own report, and every figure with the caption its own report gives it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from ntpflow.experiments import llm_report, othello_report, stories_report, toy_report
from ntpflow.experiments.figure_style import SIGN
from ntpflow.experiments.llm import run_llm
from ntpflow.experiments.othello import run_othello
from ntpflow.experiments.render import STAMP, write_documents
from ntpflow.experiments.stories import run_stories
from ntpflow.experiments.toy import run_toy
from ntpflow.files import ensure_writable_dir, stamp, write_json

#: experiment name -> (its run function ``run(scale, out, **options)``, its ``write_report(out)``)
EXPERIMENTS = {
    "toy": (run_toy, toy_report.write_report),
    "othello": (run_othello, othello_report.write_report),
    "stories": (run_stories, stories_report.write_report),
    "llm": (run_llm, llm_report.write_report),
}


def run_experiment(name: str, scale: str, out: str | Path, **options) -> Path:
    """Run (or resume) one experiment into ``out``, stamp it when its numbers changed (``out``/stamp.json:
    ``files.stamp()``; a rerun that recomputes nothing keeps the stamp, so its report stays byte for byte) and write
    its report; returns the report's path."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}, all")
    run, write = EXPERIMENTS[name]
    accepted = inspect.signature(run).parameters
    before = _numbers(out)
    run(scale, out, **{k: v for k, v in options.items() if k in accepted and v is not None})
    if _numbers(out) != before or not (Path(out) / STAMP).exists():
        write_json(Path(out) / STAMP, stamp())  # this command made the numbers: the report says so
    return write(out)


def run_all(scale: str, out: str | Path, **options) -> Path:
    """Every experiment at ``scale`` into ``out/<name>``, then the combined report; returns ``out/report.html``."""
    out = ensure_writable_dir(out)
    before = [_numbers(out / name) for name in EXPERIMENTS]
    for name in EXPERIMENTS:
        run_experiment(name, scale, out / name, **options)
    if [_numbers(out / name) for name in EXPERIMENTS] != before or not (out / STAMP).exists():
        write_json(out / STAMP, stamp())
    return write_report(out)


def _numbers(out: str | Path) -> dict[str, bytes]:
    """The JSON files an experiment's report is made from (all in ``out`` but summary.json and the stamp)."""
    return {p.name: p.read_bytes() for p in sorted(Path(out).glob("*.json")) if p.name not in ("summary.json", STAMP)}


def write_report(out: str | Path) -> Path:
    """Combine ``out/<experiment>/summary.json`` and figures into ``out/report.html`` (+ .md, summary.json): every
    claim with the paper's value, ours and the verdict; per experiment a link to its own report and its figures with
    their captions."""
    out = Path(out)
    found = [n for n in EXPERIMENTS if (out / n / "summary.json").exists()]
    if not found:
        raise FileNotFoundError(f"no experiment results under {out} (expected {', '.join(EXPERIMENTS)})")
    claims, sections, pngs = [], [], {}
    for name in found:
        summary = json.loads((out / name / "summary.json").read_text())
        claims += [{**c, "experiment": name} for c in summary.get("claims", [])]
        figdir = out / name / "figures"
        captions = {f["name"]: f["caption"] for f in summary.get("figures", [])}
        stems = [f for f in captions if (figdir / f"{f}.png").exists()]
        stems += sorted(f.stem for f in figdir.glob("*.png") if f.stem not in captions) if figdir.exists() else []
        for stem in stems:
            pngs[f"{name}/{stem}"] = (figdir / f"{stem}.png").read_bytes()
        sections.append((name, summary.get("scale", "?"),
                         [(f"{name}/{stem}", captions.get(stem, stem.replace("_", " "))) for stem in stems]))
    blocks: list[tuple] = [
        ("h1", "ntpflow: reproduction of “Understanding the Emergence of Seemingly Useless Features”"),
        ("p", f"{SIGN} Each verdict follows the decision rule printed below the table, applied by the code to the numbers "
              "in the experiment's summary.json; 'not testable at this scale' means a precondition of the test "
              "failed at the scale that ran. The paper and its reported numbers are explained in docs/paper.md of "
              "the ntpflow repository."),
        ("nav", [(n, f"#{n}") for n, _, _ in sections]),
        ("h2", "Claims"),
        ("claims", claims, True),
    ]
    for name, scale, figs in sections:
        blocks.append(("h2", f"{name} (scale: {scale})", name))
        blocks.append(("links", "Full report:", [(f"{name}/report.html", f"{name}/report.html"),
                                                 (f"{name}/report.md", f"{name}/report.md")]))
        blocks += [("fig", key, f"{name}: {caption}") for key, caption in figs]
    write_documents(out, blocks, pngs, {"experiments": found})
    return out / "report.html"
