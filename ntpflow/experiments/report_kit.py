"""Shared pieces of the experiment reports: statistics, number formatting, figures and the md/html document.

A document is a list of blocks: ``("h1"|"h2"|"p", text)`` or ``("h2", text, html_id)``, ``("nav", [(text,
href), ...])``, ``("table", header, rows, html_id)`` and ``("fig", name, caption)`` (``name`` = a figure stem, or
``"<experiment>/<stem>"`` in the combined report). ``to_markdown`` and ``to_html`` render it; the HTML is self-contained (PNGs as base64
data URIs, inline CSS), and a table column named ``verdict`` is coloured by its value.
"""

from __future__ import annotations

import base64
import html
import io
import math
from functools import cache
from pathlib import Path

from ..io import atomic_write

RC = {"svg.hashsalt": "ntpflow-toy-report", "svg.fonttype": "path", "font.size": 10, "axes.titlesize": 11,
       "axes.labelsize": 10, "legend.fontsize": 9, "xtick.labelsize": 9, "ytick.labelsize": 9,
       "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.6, "axes.spines.top": False,
       "axes.spines.right": False, "path.simplify": False}
DPI = 150


def _t_central(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer ``df`` (closed-form finite series)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        acc, term = 0.0, math.cos(theta)
        if df > 1:
            acc = term
            for k in range(3, df - 1, 2):  # terms cos^k θ · (2·4···(k−1)) / (1·3···k)
                term *= c2 * (k - 1) / k
                acc += term
        return 2.0 / math.pi * (theta + s * acc) if df > 1 else 2.0 * theta / math.pi
    acc, term = 1.0, 1.0
    for k in range(2, df - 1, 2):  # terms cos^k θ · (1·3···(k−1)) / (2·4···k)
        term *= c2 * (k - 1) / k
        acc += term
    return s * acc


@cache
def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` ≥ 1 degrees of freedom (bisection, deterministic)."""
    if df < 1:
        raise ValueError(f"df must be ≥ 1, got {df}")
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_central(mid, df) < 0.95:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def finite(x) -> bool:
    """Whether ``x`` is a finite int or float (not None, NaN or ±inf)."""
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def finite_or_none(x):
    """``x`` if it is a finite number, else None (for JSON: NaN and ±inf become null)."""
    return x if finite(x) else None


def stats(values) -> dict:
    """Mean, sd, 95% t-interval (lo, hi) and n of the finite values; None where undefined."""
    xs = [float(v) for v in values if finite(v)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "sd": None, "lo": None, "hi": None, "n": 0}
    mean = math.fsum(xs) / n
    if n == 1:
        return {"mean": mean, "sd": None, "lo": None, "hi": None, "n": 1}
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    h = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "lo": mean - h, "hi": mean + h, "n": n}


def mean_of(values) -> float | None:
    """Mean of the finite values; None if there are none."""
    xs = [float(v) for v in values if finite(v)]
    return math.fsum(xs) / len(xs) if xs else None


def has_ci(s: dict | None) -> bool:
    """Whether the stats dict ``s`` (see :func:`stats`) has a confidence interval."""
    return s is not None and s["lo"] is not None and s["hi"] is not None


def fmt(x, digits=3) -> str:
    """``x`` with ``digits`` decimals, or "n/a" for None."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def fmt_g(x) -> str:
    """``x`` to 3 significant digits, or "n/a" for None."""
    return "n/a" if x is None else f"{x:.3g}"


def fmt_ci(s: dict | None, fmt=fmt) -> str:
    """A stats dict as "mean [lo, hi]", "mean (n=N)" without an interval, or "n/a"; numbers through ``fmt``."""
    if s is None or s["mean"] is None:
        return "n/a"
    if has_ci(s):
        return f"{fmt(s['mean'])} [{fmt(s['lo'])}, {fmt(s['hi'])}]"
    return f"{fmt(s['mean'])} (n={s['n']})"


def save_figure(fig, figdir: Path, name: str) -> bytes:
    """Write ``name``.png and ``name``.svg atomically; returns the PNG bytes."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    out = {}
    with matplotlib.rc_context(RC):
        for fmt, kw in (("png", {"dpi": DPI}), ("svg", {"metadata": {"Date": None}})):
            buf = io.BytesIO()
            fig.savefig(buf, format=fmt, **kw)
            out[fmt] = buf.getvalue()
            atomic_write(figdir / f"{name}.{fmt}", out[fmt])
    return out["png"]


def figure_grid(width, height, nrows, ncols, *, left, right, top, bottom, wspace, hspace=0.0, **kw):
    """A figure of ``width`` × ``height`` inches with an nrows × ncols grid of axes; margins and gaps in inches.

    A fixed layout (no constrained layout): faster, and the same on every run.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    axw = (width - left - right - (ncols - 1) * wspace) / ncols
    axh = (height - top - bottom - (nrows - 1) * hspace) / nrows
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
                        wspace=wspace / axw, hspace=hspace / axh)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def finish_figure(fig, title, handles, labels, ncol):
    """Title at the top, one legend for the whole figure at the bottom."""
    fig.suptitle(title, y=1 - 0.08 / fig.get_figheight(), va="top")
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, frameon=False)


def ci_band(ax, xs, rows, color, alpha=0.18):
    """Shade the 95% intervals of ``rows`` (stats dicts) over ``xs`` on ``ax`` when at least 2 points have one."""
    pts = [(x, r["lo"], r["hi"]) for x, r in zip(xs, rows) if has_ci(r)]
    if len(pts) >= 2:
        ax.fill_between([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], color=color, alpha=alpha,
                        lw=0)


def _md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _figure_path(name: str) -> str:
    """``figures/<name>`` for a report's own figure, ``<experiment>/figures/<stem>`` for ``"<experiment>/<stem>"``."""
    folder, _, stem = name.rpartition("/")
    return f"{folder}/figures/{stem}" if folder else f"figures/{stem}"


def to_markdown(blocks) -> str:
    """Markdown of the report blocks (``h1``, ``h2``, ``p``, ``table``, ``nav``, ``fig`` tuples)."""
    out = []
    for blk in blocks:
        kind = blk[0]
        if kind == "h1":
            out.append(f"# {blk[1]}")
        elif kind == "h2":
            out.append(f"## {blk[1]}")
        elif kind == "p":
            out.append(blk[1])
        elif kind == "table":
            _, header, rows, _id = blk
            lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
            out.append("\n".join(lines))
        elif kind == "nav":
            out.append(" · ".join(f"[{text}]({href})" for text, href in blk[1]))
        elif kind == "fig":
            _, name, caption = blk
            path = _figure_path(name)
            out.append(f"![{name}]({path}.png)\n\n*{caption}* (vector: [{path}.svg]({path}.svg))")
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
td.v-inconclusive { background: #fcf8e3; }
""".strip()


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
            anchor = f' id="{e(blk[2])}"' if len(blk) > 2 else ""
            out.append(f"<{kind}{anchor}>{e(blk[1])}</{kind}>")
        elif kind == "nav":
            out.append("<nav>" + " · ".join(f'<a href="{e(href)}">{e(text)}</a>' for text, href in blk[1]) + "</nav>")
        elif kind == "table":
            _, header, rows, tid = blk
            t = [f'<table id="{e(tid)}">' if tid else "<table>",
                 "<thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr></thead>", "<tbody>"]
            for r in rows:
                cells = []
                for h, c in zip(header, r):
                    cls = f' class="v-{c.replace(" ", "-")}"' if h == "verdict" else ""
                    cells.append(f"<td{cls}>{e(str(c))}</td>")
                t.append("<tr>" + "".join(cells) + "</tr>")
            t.append("</tbody></table>")
            out.append("\n".join(t))
        elif kind == "fig":
            _, name, caption = blk
            nfig += 1
            data = base64.b64encode(pngs[name]).decode("ascii")
            out.append(f'<figure id="fig-{e(name)}"><img alt="{e(name)}" src="data:image/png;base64,{data}">'
                       f"<figcaption><b>Figure {nfig}.</b> {e(caption)}</figcaption></figure>")
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"


def write_from_data(out_dir: str | Path, summarize, make_figures, document) -> Path:
    """The report pipeline of an experiment folder: read ``data.json``, ``summary = summarize(data)``, figures
    (``make_figures(summary, figdir) -> {name: png bytes}``), blocks (``document(summary, pngs)``); write
    summary.json, report.md and report.html atomically. Returns report.md's path."""
    import json

    out = Path(out_dir)
    path = out / "data.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"missing file {path}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"corrupted JSON in {path}: {err}") from None
    summary = summarize(data)
    pngs = make_figures(summary, out / "figures")
    blocks = document(summary, pngs)
    atomic_write(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True, allow_nan=False,
                                                  ensure_ascii=False) + "\n")
    atomic_write(out / "report.md", to_markdown(blocks))
    atomic_write(out / "report.html", to_html(blocks, pngs))
    return out / "report.md"


def plain_number(v) -> str:
    """A setting for a table: whole floats >= 1 without ``.0``, anything else as ``str``."""
    if isinstance(v, float) and v == int(v) and abs(v) >= 1:
        return str(int(v))
    return str(v)


def sites_text(sites) -> str:
    """``[[layer, pos], ...]`` -> ``"layer 1 × positions 4, 8; layer 2 × positions 4"`` (``"none"`` if empty)."""
    by_layer: dict = {}
    for layer, pos in sites:
        by_layer.setdefault(layer, []).append(pos)
    if not by_layer:
        return "none"
    return "; ".join(f"layer {k} × positions {', '.join(str(p) for p in sorted(v))}"
                     for k, v in sorted(by_layer.items()))


def report_main(module: str, experiment: str, write_report, argv=None) -> None:
    """Command line of a report module (``python -m ntpflow.experiments.<module>``): write the report of the
    experiment's output folder OUT and print the path ``write_report`` returns."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m ntpflow.experiments.{module}",
                                 description=f"Write the {experiment} report from the results in OUT.")
    ap.add_argument("out", help=f"the output folder of the {experiment} experiment")
    print(write_report(ap.parse_args(argv).out))
