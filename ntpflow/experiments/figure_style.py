"""The one figure style of every ntpflow report: colours, layout, interval bands and the words that go with them.

Every figure states its unit on the axes, ``n`` and the interval type (:func:`ci_label`), and the sign convention
(:data:`SIGN`) when it shows influence. One palette per meaning, defined here and nowhere else, and no colour shared
between two meanings: training regimes (:data:`REGIME_COLORS`), decomposition components
(:data:`COMPONENT_COLORS`), NTP-useful/useless square types (:data:`TYPE_COLORS`), the LLM report's domains and
latent groups (:data:`DOMAIN_COLORS`, :data:`GROUP_COLORS`); ordered things (layers, seeds, ranks) take a
sequential colour map (:func:`ordered_colors`). A baseline (step 0, untrained, "no steering") is always grey and
dashed. Axes are linear; a whisker cut at an axis or a quantity's range gets an arrowhead (:func:`error_bars`), and
points off an axis get a marker at its edge (:func:`mark_off_axis`). An influence panel states its residual and is
framed in red with "precondition fails" when its decomposition fails the precondition (:func:`account_note`); the
paper's values are interval marks on an axis of their own (:func:`paper_intervals`), never bars beside ours.
Layout is matplotlib's constrained layout, so titles, labels and the figure legend never overlap or leave the canvas.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from cycler import cycler

from ntpflow.files import atomic_write

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

OKABE_ITO = {"orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73", "yellow": "#F0E442", "blue": "#0072B2",
             "vermillion": "#D55E00", "purple": "#CC79A7", "black": "#000000"}
BASELINE = "#7F7F7F"  # step 0 / untrained / no intervention
REGIME_COLORS = {"vanilla": OKABE_ITO["blue"], "myopic": OKABE_ITO["vermillion"], "untied": OKABE_ITO["green"],
                 "myopic-untied": OKABE_ITO["purple"]}
COMPONENT_COLORS = {"direct": OKABE_ITO["orange"], "pre_cached": OKABE_ITO["sky"], "shared": "#6A3D9A",
                    "full": "#333333"}
TYPE_COLORS = {"all": OKABE_ITO["black"], "useful": "#117733", "useless": "#882255"}  # NTP-useful / useless
DOMAIN_COLORS = {"stories": "#44AA99", "code": "#332288", "math": "#DDCC77"}  # LLM corpus domains
GROUP_COLORS = {"formal": DOMAIN_COLORS["code"], "other": DOMAIN_COLORS["stories"],  # formal = code + math latents
                "high": "#661100", "low": "#6699CC", "baseline": BASELINE}  # high- / low-Q latents
PALETTES = {"regime": REGIME_COLORS, "component": COMPONENT_COLORS, "type": TYPE_COLORS, "domain": DOMAIN_COLORS,
            "group": GROUP_COLORS}
NOTE_GID = "account-note"  # marks the text of an account note (:func:`account_note`)
FAIL_COLOR = "#CC0000"  # the mark of a decomposition that fails its precondition (nothing else is this red)
SIGN = "Sign convention: positive influence = the component moved the feature toward its final value."
RC: dict[RcKeyType, Any] = {
    "svg.hashsalt": "ntpflow-report", "svg.fonttype": "path", "font.size": 10, "axes.titlesize": 10,
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
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    fig = Figure(figsize=(width, height), layout="constrained")
    engine = fig.get_layout_engine()
    assert isinstance(engine, ConstrainedLayoutEngine)  # layout="constrained"
    engine.set(h_pad=0.06, w_pad=0.06)
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
    elif labels is None:
        raise TypeError("finish: handles need their labels")
    unique = {}
    for lab, h in zip(labels, handles):  # one entry per label: its first handle, in order
        unique.setdefault(lab, h)
    if unique:
        # as many columns as asked for, as long as the widest entries fit in the figure's width (~0.07 in/char)
        entry = max(len(str(lab)) for lab in unique) * 0.07 + 0.6
        fits = max(1, int(fig.get_figwidth() / entry))
        fig.legend(list(unique.values()), list(unique), loc="outside lower center",
                   ncol=max(1, min(ncol, len(unique), fits)), frameon=False)
    _clear_account_notes(fig)


def _clear_account_notes(fig) -> None:
    """Raise the top of every panel that carries an account note (and of the panels sharing its y axis) until no data
    lies under the note: the data's current y range ends just below the note's lower edge."""
    notes = [(ax, t) for ax in fig.axes for t in ax.texts if t.get_gid() == NOTE_GID]
    if not notes:
        return
    fig.draw_without_rendering()  # the layout fixes each panel's size, hence the note's height in panel units
    below = {}  # one y axis (its first sibling) -> the lowest note's lower edge, in panel units
    for ax, note in notes:
        key = min(ax.get_shared_y_axes().get_siblings(ax), key=fig.axes.index)
        edge = note.get_window_extent().transformed(ax.transAxes.inverted()).y0 - 0.02
        below[key] = min(below.get(key, 1.0), edge)
    for ax, edge in below.items():
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, lo + (hi - lo) / max(edge, 0.3))


@overload
def clip(lo: float, hi: float, bounds: tuple[float | None, float | None] | None) -> tuple[float, float]: ...
@overload
def clip(lo: float | None, hi: float | None, bounds: tuple[float | None, float | None] | None
         ) -> tuple[float | None, float | None]: ...
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
    get none (a bar of height 0 with a CI still gets its whisker). A whisker cut by ``bounds`` ends in an arrowhead
    instead of a cap; returns the number cut."""
    pts = [(x, r["mean"], *clip(r["lo"], r["hi"], bounds), r["lo"], r["hi"]) for x, r in zip(xs, rows)
           if r is not None and r.get("mean") is not None and r.get("lo") is not None and r.get("hi") is not None]
    if not pts:
        return 0
    ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                yerr=[[max(0.0, p[1] - p[2]) for p in pts], [max(0.0, p[3] - p[1]) for p in pts]],
                fmt="none", ecolor=color, capsize=2.5, elinewidth=1)
    cut = [(p[0], p[2], "v") for p in pts if p[2] > p[4]] + [(p[0], p[3], "^") for p in pts if p[3] < p[5]]
    for x, y, marker in cut:
        ax.plot([x], [y], marker=marker, color=color, ms=6, zorder=4, clip_on=False)
    return len(cut)


def mark_off_axis(ax, xs, ys, lo=None, hi=None, color="#000000") -> int:
    """Set the y-axis to [lo, hi] (None: matplotlib's) and mark each point of (xs, ys) beyond it with an arrowhead at
    the edge and a note in the corner ("▲ n off scale"); returns the number off the axis."""
    ax.set_ylim(bottom=lo, top=hi)
    bottom, top = ax.get_ylim()
    above = [x for x, y in zip(xs, ys) if y is not None and y > top]
    below = [x for x, y in zip(xs, ys) if y is not None and y < bottom]
    for pts, y, marker in ((above, top, "^"), (below, bottom, "v")):
        if pts:
            ax.plot(pts, [y] * len(pts), ls="none", marker=marker, color=color, ms=5, clip_on=False, zorder=4)
    if above or below:
        ax.text(0.99, 0.98, f"▲▼ {len(above) + len(below)} points off scale", transform=ax.transAxes, ha="right",
                va="top", fontsize=8)
    return len(above) + len(below)


def account_note(ax, text: str, ok: bool) -> None:
    """State an influence panel's account in its top-left corner (``text``: the exact account's largest
    |residual| / R_H(θ_0), or "paper's reading, balance x"; lines wrapped to the panel's width); a failed
    precondition frames the panel in red and says so. :func:`finish` makes room above the data for it."""
    fig = ax.get_figure()
    chars = max(20, int(ax.get_position().width * fig.get_figwidth() * 14))  # 8-pt characters across the panel
    lines = [w for line in (text if ok else f"✗ precondition fails: {text}").split("\n")
             for w in textwrap.wrap(line, chars)]
    note = ax.text(0.01, 0.99, "\n".join(lines), transform=ax.transAxes, ha="left", va="top", fontsize=8,
                   color="#000000" if ok else FAIL_COLOR, zorder=6,
                   bbox={"facecolor": "white", "edgecolor": "none" if ok else FAIL_COLOR, "alpha": 0.85, "pad": 1.5})
    note.set_in_layout(False)  # the note sits inside the panel; the layout must not make room for it
    note.set_gid(NOTE_GID)  # finish() raises the panel's top so that no data lies under the note
    if not ok:
        for side in ax.spines.values():
            side.set_visible(True)
            side.set_edgecolor(FAIL_COLOR)
            side.set_linewidth(2.0)


def paper_intervals(ax, xs, intervals, color="#000000", label: str | None = "paper's 95% CI") -> None:
    """The paper's values as interval marks (a vertical line from lo to hi with flat ends, no bar, no midpoint) at
    ``xs``; ``intervals`` = [(lo, hi) or None]. Draw them on an axis of their own, labelled with the paper's unit."""
    pts = [(x, lo, hi) for x, iv in zip(xs, intervals) if iv is not None for lo, hi in [iv]]
    if pts:
        ax.vlines([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], color=color, lw=2.2, label=label)
        for cap in (1, 2):
            ax.plot([p[0] for p in pts], [p[cap] for p in pts], ls="none", marker="_", ms=12, mew=2.2, color=color)


def seed_points(ax, x, values, color: str | None = "#000000", width=0.0) -> None:
    """Every seed's value as a point at ``x`` (spread over ``width`` so equal values stay visible)."""
    vals = [v for v in values if v is not None]
    if vals:
        n = len(vals)
        offs = [width * (i / (n - 1) - 0.5) if n > 1 else 0.0 for i in range(n)]
        ax.scatter([x + o for o in offs], vals, s=12, color=color, edgecolor="white", linewidth=0.5, zorder=5)


def ordered_colors(n: int, cmap: str = "viridis") -> list:
    """``n`` colours of a sequential map for ordered things (layers, seeds, ranks): never a categorical colour."""
    from matplotlib import colormaps

    m = colormaps[cmap]
    return [m(0.05 + 0.85 * i / max(1, n - 1)) for i in range(n)]


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
