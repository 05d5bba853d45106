"""The one figure style of every ntpflow report: colours, layout, interval bands and the words that go with them.

Every figure states its unit on the axes, ``n`` and the interval type (:func:`ci_label`), and the sign convention
(:data:`SIGN`) when it shows influence. Colours are the Okabe–Ito palette (distinguishable with every common colour
vision deficiency); a baseline (step 0, untrained, "no steering") is always grey and dashed. Layout is matplotlib's
constrained layout, so titles, labels and the figure legend never overlap or leave the canvas.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

from cycler import cycler

from ntpflow.files import atomic_write

OKABE_ITO = {"orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73", "yellow": "#F0E442", "blue": "#0072B2",
             "vermillion": "#D55E00", "purple": "#CC79A7", "black": "#000000"}
BASELINE = "#7F7F7F"  # step 0 / untrained / no intervention
COMPONENT_COLORS = {"direct": OKABE_ITO["orange"], "pre_cached": OKABE_ITO["sky"], "shared": "#6A3D9A",
                    "full": "#333333"}
SIGN = "Sign convention: positive influence = the component moved the feature toward its final value."
RC = {"svg.hashsalt": "ntpflow-report", "svg.fonttype": "path", "font.size": 10, "axes.titlesize": 10,
      "axes.labelsize": 10, "legend.fontsize": 9, "xtick.labelsize": 9, "ytick.labelsize": 9, "figure.titlesize": 11,
      "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.6, "axes.spines.top": False,
      "axes.spines.right": False, "path.simplify": False,
      "axes.prop_cycle": cycler(color=[OKABE_ITO[k] for k in ("blue", "orange", "green", "vermillion", "purple",
                                                              "sky", "yellow", "black")])}
DPI = 150


def style():
    """The context in which every report figure is created: ``with style(): fig, axes = figure(...)``."""
    import matplotlib

    return matplotlib.rc_context(RC)


def ci_label(n: int | None, over: str, kind: str = "95% t-CI") -> str:
    """What a band or whisker shows, with ``n``: ``"95% t-CI over n = 3 seeds"``; ``"1 seed: no CI"`` when n < 2."""
    if not n:
        return f"no {over}: no CI"
    if n < 2:
        return f"1 {over.rstrip('s')}: no CI"
    return f"{kind} over n = {n} {over}"


def figure(width: float, height: float, nrows: int = 1, ncols: int = 1, **kw):
    """A ``width`` × ``height``-inch figure with an nrows × ncols grid of axes (always 2-D), in constrained layout."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    fig.get_layout_engine().set(h_pad=0.06, w_pad=0.06)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def finish(fig, title: str, handles=None, labels=None, ncol: int = 1) -> None:
    """Title at the top (wrapped to the figure's width) and one legend for the whole figure below the axes (both
    inside the canvas): of ``handles`` and ``labels``, or by default of every labelled artist of the axes; a label
    given twice gets one entry."""
    width = max(20, int(fig.get_figwidth() * 11))  # characters of an 11-pt title line that fit the figure's width
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")))
    if handles is None:
        pairs = [ax.get_legend_handles_labels() for ax in fig.axes]
        handles, labels = [h for hs, _ in pairs for h in hs], [lab for _, ls in pairs for lab in ls]
    unique = {}
    for lab, h in zip(labels, handles):  # one entry per label: its first handle, in order
        unique.setdefault(lab, h)
    if unique:
        # as many columns as asked for, as long as the widest entries fit in the figure's width (~0.07 in/char)
        entry = max(len(str(lab)) for lab in unique) * 0.07 + 0.6
        fits = max(1, int(fig.get_figwidth() / entry))
        fig.legend(list(unique.values()), list(unique), loc="outside lower center",
                   ncol=max(1, min(ncol, len(unique), fits)), frameon=False)


def clip(lo, hi, bounds):
    """``(lo, hi)`` clipped to ``bounds`` = (min, max) (None = unbounded); None stays None."""
    if bounds is None:
        return lo, hi
    bmin, bmax = bounds
    if lo is not None and bmin is not None:
        lo = max(lo, bmin)
    if hi is not None and bmax is not None:
        hi = min(hi, bmax)
    return lo, hi


def ci_band(ax, xs, rows, color, alpha=0.18, bounds=None):
    """Shade the intervals of ``rows`` (dicts with lo, hi) over ``xs`` where at least 2 points have one; each bound
    clipped to ``bounds`` = (min, max) of the quantity (e.g. (−1, 1) for a Pearson r); say so in the caption."""
    pts = [(x, *clip(r["lo"], r["hi"], bounds)) for x, r in zip(xs, rows)
           if r is not None and r.get("lo") is not None and r.get("hi") is not None]
    if len(pts) >= 2:
        ax.fill_between([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], color=color, alpha=alpha,
                        lw=0)


def mean_line(ax, rows, x: str, color, band: bool = False, bounds=None, band_alpha=0.18, **plot_kw):
    """Plot the ``mean`` of ``rows`` over their key ``x`` in ``color`` (with the band of their intervals, clipped to
    ``bounds``, under it when ``band``); returns the line, or None (nothing drawn) without rows."""
    if not rows:
        return None
    xs = [r[x] for r in rows]
    if band:
        ci_band(ax, xs, rows, color, alpha=band_alpha, bounds=bounds)
    return ax.plot(xs, [r["mean"] for r in rows], color=color, **plot_kw)[0]


def error_bars(ax, xs, rows, color="#000000", bounds=None):
    """Whiskers from each row's lo to hi (dicts with mean, lo, hi), clipped to ``bounds``; rows without an interval
    get none (a bar of height 0 with a CI still gets its whisker)."""
    pts = [(x, r["mean"], *clip(r["lo"], r["hi"], bounds)) for x, r in zip(xs, rows)
           if r is not None and r.get("mean") is not None and r.get("lo") is not None and r.get("hi") is not None]
    if pts:
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                    yerr=[[max(0.0, p[1] - p[2]) for p in pts], [max(0.0, p[3] - p[1]) for p in pts]],
                    fmt="none", ecolor=color, capsize=2.5, elinewidth=1)


def save(fig, figdir: Path, name: str) -> bytes:
    """Write ``name``.png and ``name``.svg atomically (SVG without a date: the same figure gives the same bytes);
    returns the PNG bytes."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    out = {}
    with matplotlib.rc_context(RC):
        for fmt, kw in (("png", {"dpi": DPI}), ("svg", {"metadata": {"Date": None}})):
            buf = io.BytesIO()
            fig.savefig(buf, format=fmt, **kw)
            out[fmt] = buf.getvalue()
            atomic_write(Path(figdir) / f"{name}.{fmt}", out[fmt])
    return out["png"]
