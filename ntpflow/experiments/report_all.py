"""Every experiment in one go, and one self-contained page that gathers their claims and figures.

``run_all(scale, out)`` runs each experiment of ``ntpflow.experiments.EXPERIMENTS`` into ``out/<experiment>`` (each
resumable) and writes its report; ``write_report(out)`` then writes ``out/report.html`` (no network needed to view
it: inline CSS, figures as data URIs), ``out/report.md`` and ``out/summary.json``. The page has the claims table of
all experiments (claim, our number, verdict), one section per experiment linked from the top, and every figure.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from ..io import atomic_write, ensure_writable_dir
from . import EXPERIMENTS
from .report_kit import to_html, to_markdown


def run_experiment(name: str, scale: str, out: str | Path, **options) -> Path:
    """Run (or resume) one experiment into ``out`` and write its report; returns the report's path."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}, all")
    module, fn, report_module = EXPERIMENTS[name]
    run = getattr(importlib.import_module(f"ntpflow.experiments.{module}"), fn)
    accepted = inspect.signature(run).parameters
    run(scale, out, **{k: v for k, v in options.items() if k in accepted and v is not None})
    return importlib.import_module(f"ntpflow.experiments.{report_module}").write_report(out)


def run_all(scale: str, out: str | Path, **options) -> Path:
    """Every experiment at ``scale`` into ``out/<name>``, then the combined report; returns ``out/report.html``."""
    out = ensure_writable_dir(out)
    for name in EXPERIMENTS:
        run_experiment(name, scale, out / name, **options)
    return write_report(out)


def write_report(out: str | Path) -> Path:
    """Combine ``out/<experiment>/summary.json`` and figures into ``out/report.html`` (+ .md, summary.json)."""
    out = Path(out)
    found = [n for n in EXPERIMENTS if (out / n / "summary.json").exists()]
    if not found:
        raise FileNotFoundError(f"no experiment results under {out} (expected {', '.join(EXPERIMENTS)})")
    claims, sections, pngs = [], [], {}
    for name in found:
        summary = json.loads((out / name / "summary.json").read_text())
        for c in summary.get("claims", []):
            claims.append({"experiment": name, "claim": str(c.get("claim", "")), "paper": str(c.get("paper", "")),
                           "measured": str(c.get("measured", "")), "verdict": str(c.get("verdict", "inconclusive"))})
        figs = sorted((out / name / "figures").glob("*.png")) if (out / name / "figures").exists() else []
        for f in figs:
            pngs[f"{name}/{f.stem}"] = f.read_bytes()
        sections.append((name, summary.get("scale", "?"), [f"{name}/{f.stem}" for f in figs]))
    blocks: list[tuple] = [
        ("h1", "ntpflow: reproduction of “Understanding the Emergence of Seemingly Useless Features”"),
        ("p", "Sign convention: positive influence = the component moved the feature toward its final value. "
              "Verdicts follow the explicit rules in each experiment's own report."),
        ("nav", [(n, f"#{n}") for n, _, _ in sections]),
        ("h2", "Claims"),
        ("table", ["experiment", "claim", "paper", "ours", "verdict"],
         [[c["experiment"], c["claim"], c["paper"], c["measured"], c["verdict"]] for c in claims], "claims"),
    ]
    for name, scale, figs in sections:
        blocks.append(("h2", f"{name} (scale: {scale})", name))
        blocks.append(("p", f"Full report: {name}/report.html ({name}/report.md)."))
        blocks += [("fig", f, f"{name}: {f.split('/', 1)[1].replace('_', ' ')}") for f in figs]
    atomic_write(out / "report.html", to_html(blocks, pngs))
    atomic_write(out / "report.md", to_markdown(blocks))
    atomic_write(out / "summary.json", json.dumps({"experiments": found, "claims": claims}, indent=2) + "\n")
    return out / "report.html"
