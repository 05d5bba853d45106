"""Report of the OthelloGPT reproduction (docs/paper.md#othello, claim 3) from ``OUT/data.json``.

``write_report(out_dir)`` reads ``out_dir/data.json`` (``ntpflow.experiments.othello.run_othello``; schema in
docs/outputs.md) and writes ``figures/``, ``summary.json``, ``report.md`` and ``report.html``. Layers: ``resid[k]``
= output of block k − 1 (docs/conventions.md); position ``p`` = after reading move ``p``. Statistics: one training
run (seed 0), so the units are squares (probe quality: a 95% t-interval over the 64 squares of each square's mean
over the cells shown) and square × position × layer (influence: the tracked units whose per-type risk was defined).
Sign convention: positive influence = the component moved the feature toward its final value.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    Claim,
    Rule,
    at_least,
    every,
    interval_above,
    interval_contains,
)
from .report_kit import (
    RC,
    draw_figures,
    ci_band,
    figure_grid,
    finish_figure,
    finite,
    fmt,
    fmt_ci,
    fmt_g,
    mean_of,
    report_main,
    save_figure,
    stats,
    write_from_data,
)
from .report_kit import (
    plain_number as _plain,
)
from .report_kit import (
    sites_text as _sites_text,
)

COMPONENTS = ("direct", "pre_cached", "shared", "full")
COMPONENT_LABELS = {"direct": "direct", "pre_cached": "pre-caching", "shared": "shared", "full": "combined"}
COMPONENT_COLORS = {"direct": "#E69F00", "pre_cached": "#56B4E9", "shared": "#6A3D9A", "full": "#333333"}
TYPE_COLORS = {"all": "#333333", "useless": "#D55E00", "useful": "#0072B2"}
PROBE_TYPES = ("all", "useless", "useful")
METRICS = {"r": "ridge probe Pearson r", "acc": "3-way classifier accuracy"}
BASELINE_COLOR = "#7F7F7F"
TRAINED_COLOR = "#0072B2"
STEP0_LABEL = "step 0 (untrained baseline; right: mean over layers ≥ 1)"
METRIC_BOUNDS = {"r": (-1.0, 1.0), "acc": (0.0, 1.0)}

SIGN = "Sign convention: positive = the component moved the feature toward its final value."
INFLUENCE_UNIT = "probe units² (first-order reduction of the squared probe mismatch, summed over steps)"
PAPER_CI = {  # docs/paper.md#numbers (95% CIs, second-hand); unit unknown
    ("direct", "useful"): (2.85, 12.38), ("direct", "useless"): (-4.69, 2.74),
    ("pre_cached", "useful"): (-1.99, 0.66), ("pre_cached", "useless"): (0.55, 3.05),
    ("shared", "useful"): (4.80, 12.48), ("shared", "useless"): (2.93, 9.91),
    ("full", "useful"): (12.14, 19.05), ("full", "useless"): (4.42, 10.07),
}
PAPER_SETTINGS = {"n_layer": "6", "d_model": "256", "n_head": "4", "batch_size": "1024", "steps": "5000",
                  "lr": "0.001", "n_train": "unknown (pre-generated)", "n_eval": "20480",
                  "sites": "layers 1–6 × positions 4, 8, …, 56", "squares": "16 central (C3–F6)"}
SETTING_KEYS = ("n_layer", "d_model", "n_head", "batch_size", "steps", "lr", "n_train", "n_eval")

# ---------------------------------------------------------------------------------------------------- statistics


def slope(xs, ys) -> float | None:
    """Least-squares slope of the finite (x, y) pairs; None with fewer than 2 distinct x."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if finite(y)]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


class _Probes:
    """Lookup of the per-square probe values: ``get(weights, metric, type, layer, pos)`` → list of F (or None)."""

    def __init__(self, records):
        self.v = {(r["weights"], r["metric"], r["type"], r["layer"], r["pos"]): r["values"] for r in records}
        self.layers = sorted({r["layer"] for r in records})
        self.positions = sorted({r["pos"] for r in records})
        self.n_sq = max((len(r["values"]) for r in records), default=0)

    def get(self, *key):
        """Values of the key (weights, metric, type, layer, pos): a list with one per square, or None."""
        return self.v.get(key)

    def per_square(self, weights, metric, typ, cells):
        """For each square, the mean of its values over ``cells`` [(layer, pos)]."""
        out = []
        for j in range(self.n_sq):
            out.append(mean_of((self.get(weights, metric, typ, k, p) or [None] * self.n_sq)[j] for k, p in cells))
        return out

    def gap_square(self, weights, metric, layer, pos):
        """Per square: useful − useless at (layer, pos), None where either is undefined."""
        u = self.get(weights, metric, "useful", layer, pos)
        s = self.get(weights, metric, "useless", layer, pos)
        if u is None or s is None:
            return [None] * self.n_sq
        return [a - b if finite(a) and finite(b) else None for a, b in zip(u, s)]

    def gap_per_square(self, weights, metric, cells):
        """Per square: the mean over ``cells`` [(layer, pos)] of useful − useless (see :meth:`gap_square`)."""
        gaps = [self.gap_square(weights, metric, k, p) for k, p in cells]
        return [mean_of(g[j] for g in gaps) for j in range(self.n_sq)]


def summarize(data: dict) -> dict:
    """Every aggregate of the report and the claims table from the parsed data.json (pure, no I/O)."""
    pr = _Probes(data.get("probes") or [])
    layers, positions = pr.layers, pr.positions
    upper = [k for k in layers if k >= 1]
    weights_present = sorted({r["weights"] for r in data.get("probes") or []}, key=lambda w: w != "final")

    # ---- probe quality
    by_layer, by_pos, grid = [], [], []
    for metric in METRICS:
        for w in weights_present:
            for typ in PROBE_TYPES:
                for k in layers:
                    s = stats(pr.per_square(w, metric, typ, [(k, p) for p in positions]))
                    if s["n"]:
                        by_layer.append({"metric": metric, "weights": w, "type": typ, "layer": k, **s})
                    for p in positions:
                        vals = pr.get(w, metric, typ, k, p)
                        m = mean_of(vals or [])
                        if m is not None:
                            grid.append({"metric": metric, "weights": w, "type": typ, "layer": k, "pos": p,
                                         "mean": m})
                for p in positions:
                    s = stats(pr.per_square(w, metric, typ, [(k, p) for k in upper]))
                    if s["n"]:
                        by_pos.append({"metric": metric, "weights": w, "type": typ, "pos": p, **s})

    # ---- Fig. 3: gap useful − useless
    gap_layer, gap_pos, gap_grid, gap_slopes = [], [], [], {}
    for metric in METRICS:
        for w in weights_present:
            per_layer = {}
            for k in layers:
                per_layer[k] = pr.gap_per_square(w, metric, [(k, p) for p in positions])
                s = stats(per_layer[k])
                if s["n"]:
                    gap_layer.append({"metric": metric, "weights": w, "layer": k, **s})
                for p in positions:
                    m = mean_of(pr.gap_square(w, metric, k, p))
                    if m is not None:
                        gap_grid.append({"metric": metric, "weights": w, "layer": k, "pos": p, "mean": m})
            per_pos = {}
            for p in positions:
                per_pos[p] = pr.gap_per_square(w, metric, [(k, p) for k in upper])
                s = stats(per_pos[p])
                if s["n"]:
                    gap_pos.append({"metric": metric, "weights": w, "pos": p, **s})
            sl_layer = [slope(upper, [per_layer[k][j] for k in upper]) for j in range(pr.n_sq)]
            sl_pos = [slope(positions, [per_pos[p][j] for p in positions]) for j in range(pr.n_sq)]
            mean_upper = stats(mean_of(per_layer[k][j] for k in upper) for j in range(pr.n_sq))
            gap_slopes[f"{metric}/{w}"] = {"per_layer": stats(sl_layer), "per_move": stats(sl_pos),
                                          "mean_layers_ge1": mean_upper}

    # ---- integrated influence table
    units = defaultdict(list)
    site_means = defaultdict(list)
    for r in data.get("influence") or []:
        if r["component"] in COMPONENTS:
            units[(r["component"], r["type"])].append(r["total"])
            site_means[(r["layer"], r["pos"], r["component"], r["type"])].append(r["total"])
    table = {}
    for c in COMPONENTS:
        for t in ("useful", "useless", "all"):
            s = stats(units.get((c, t), ()))
            table[f"{c}/{t}"] = {**s, "paper": list(PAPER_CI[(c, t)]) if (c, t) in PAPER_CI else None}
    per_site = []
    for (k, p, c, t), vals in sorted(site_means.items()):
        if t in ("useful", "useless"):
            per_site.append({"layer": k, "pos": p, "component": c, "type": t, **stats(vals)})

    curves = [r for r in data.get("curves") or [] if r["type"] in ("useful", "useless")
              and r["component"] in COMPONENTS]
    sanity = data.get("sanity") or []
    sanity_s = {"R0_minus_RT_eval": stats(r["R0_minus_RT_eval"] for r in sanity),
                "adam_full": stats(r["adam_full"] for r in sanity)}

    run = data.get("run") or {}
    timings = data.get("timings") or {}
    cfg = data.get("config") or {}
    steps = cfg.get("steps")
    step_times = {}
    if steps and finite(timings.get("train")):
        step_times["train_s_per_step"] = timings["train"] / steps
    if steps and finite(timings.get("attribution")):
        step_times["tracked_s_per_step"] = timings["attribution"] / steps

    summary = {
        "scale": data.get("scale"), "scale_note": data.get("scale_note", ""), "seed": data.get("seed"),
        "config": cfg, "n_params": data.get("n_params"), "sites": data.get("sites") or [],
        "squares": data.get("squares") or [], "settings": _settings(data), "timings": timings,
        "step_times": step_times, "sign_convention": SIGN, "influence_unit": INFLUENCE_UNIT,
        "ci": ("two-sided 95% Student-t intervals; probe quality over squares (n ≤ 64), influence over units "
               "square × position × layer; lo/hi null when n < 2"),
        "run": {k: run.get(k) for k in ("legal_acc", "first_acc", "eval_loss")},
        "eval_curve": data.get("eval_curve") or [], "train_curve": data.get("train_curve") or [],
        "layers": layers, "positions": positions,
        "probe_by_layer": by_layer, "probe_by_pos": by_pos, "probe_grid": grid,
        "gap_by_layer": gap_layer, "gap_by_pos": gap_pos, "gap_grid": gap_grid, "gap_slopes": gap_slopes,
        "influence": table, "influence_by_site": per_site, "influence_curves": curves, "sanity": sanity_s,
    }
    summary["claims"] = [c.to_dict() for c in claims(summary)]
    return summary


def _settings(data: dict) -> list[dict]:
    cfg = data.get("config") or {}
    rows = [{"setting": "scale", "this_run": f"{data.get('scale', '?')} ({data.get('scale_note', '')})",
             "paper": "paper", "differs": data.get("scale") != "paper"}]
    for k in SETTING_KEYS:
        v = _plain(cfg.get(k, "?"))
        rows.append({"setting": k, "this_run": v, "paper": PAPER_SETTINGS[k], "differs": v != PAPER_SETTINGS[k]})
    sites = _sites_text(data.get("sites") or [])
    paper_sites = {(k, p) for k in range(1, 7) for p in range(4, 57, 4)}
    rows.append({"setting": "sites", "this_run": sites, "paper": PAPER_SETTINGS["sites"],
                 "differs": {tuple(s) for s in data.get("sites") or []} != paper_sites})
    sq = data.get("squares") or []
    central = {f"sq_{c}{r}" for c in "CDEF" for r in range(3, 7)}
    rows.append({"setting": "squares", "this_run": f"{len(sq)}: {', '.join(s.removeprefix('sq_') for s in sq)}",
                 "paper": PAPER_SETTINGS["squares"], "differs": set(sq) != central})
    rows.append({"setting": "seed", "this_run": str(data.get("seed")), "paper": "0", "differs": data.get("seed") != 0})
    rows.append({"setting": "parameters", "this_run": str(data.get("n_params")), "paper": "4771840",
                 "differs": data.get("n_params") != 4771840})
    return rows


# ---------------------------------------------------------------------------------------------------- claims


def _row(summary, key):
    return summary["influence"].get(key) or {"mean": None, "lo": None, "hi": None, "n": 0}


def _gap_rule() -> Rule:
    """Claim (i): the final ridge-r gap, per layer ≥ 1 and its slopes over layers and moves (95% t-CI over squares)."""

    def decide(n):
        gaps, sl = n["gap_by_layer"], n["slopes"]
        if any(g["hi"] is not None and g["hi"] < 0 for g in gaps) or (sl["mean_gap"] is not None and
                                                                      sl["mean_gap"] <= 0):
            return NOT_REPRODUCED
        los = [g["lo"] for g in gaps] + [sl["per_layer_lo"], sl["per_move_lo"]]
        return REPRODUCED if all(x is not None and x > 0 for x in los) else INCONCLUSIVE

    return Rule("Final weights, ridge r. Per square, gap = r(useful rows) − r(useless rows) at each (layer, position) "
                "where both are defined; by layer = the square's mean over positions; by move = its mean over layers "
                "≥ 1; slopes = per square, the least-squares slope of its gap over layers 1..L and over positions. "
                "95% t-CIs over squares. Reproduced if every layer ≥ 1 has its gap CI above 0 and both slope CIs "
                "lie above 0; not reproduced if some layer ≥ 1 has its gap CI below 0 or the mean gap over layers ≥ 1 "
                "is ≤ 0; otherwise inconclusive.", decide)


def claims(summary) -> list[Claim]:
    """The four OthelloGPT claims of the paper (docs/paper.md#othello), judged on ``summary``."""
    gl = [g for g in summary["gap_by_layer"] if g["metric"] == "r" and g["weights"] == "final" and g["layer"] >= 1]
    sl = summary["gap_slopes"].get("r/final") or {"per_layer": stats([]), "per_move": stats([]),
                                                    "mean_layers_ge1": stats([])}
    gap_numbers = {"gap_by_layer": [{"layer": g["layer"], "mean": g["mean"], "lo": g["lo"], "hi": g["hi"]} for g in gl],
                   "slopes": {"per_layer_lo": sl["per_layer"]["lo"], "per_move_lo": sl["per_move"]["lo"],
                              "mean_gap": sl["mean_layers_ge1"]["mean"]}}
    gap_text = ("gap by layer (final): " + "; ".join(f"L{g['layer']} {fmt_ci(g)}" for g in gl)
                + f". Slope per layer {fmt_ci(sl['per_layer'], fmt_g)}; per move {fmt_ci(sl['per_move'], fmt_g)}; "
                f"mean over layers ≥ 1 {fmt_ci(sl['mean_layers_ge1'])}") if gl else "no final ridge probes"
    n_sq = gl[0]["n"] if gl else 0
    row = {k: _row(summary, k) for k in ("direct/useful", "direct/useless", "pre_cached/useless",
                                          "pre_cached/useful", "shared/useful", "shared/useless")}

    def infl(*keys):
        return "; ".join(f"{k.replace('_', '-').replace('/', ' ')} {fmt_ci(row[k], fmt_g)} (n={row[k]['n']})"
                         for k in keys)

    def units(*keys):
        return tuple(at_least(f"units of {k.replace('/', ' ')}", row[k]["n"], 2) for k in keys)

    pc = PAPER_CI
    return [
        Claim("i", "NTP-useful squares are represented better than NTP-useless ones: the gap r(useful) − r(useless) "
              "is positive at every layer ≥ 1 and grows with layer and with move index (Fig. 3)",
              "positive at every layer, growing with layer and move index (no number given)", _gap_rule(),
              gap_numbers, gap_text, (at_least("squares", n_sq, 2), at_least("layers k ≥ 1 with a gap", len(gl), 2))),
        Claim("ii", "direct influence is positive for useful squares and not different from 0 for useless squares",
              f"useful {list(pc[('direct', 'useful')])}, useless {list(pc[('direct', 'useless')])}",
              every(interval_above("useful-square direct influence", "direct/useful"),
                    interval_contains("useless-square direct influence", "direct/useless")),
              {k: row[k] for k in ("direct/useful", "direct/useless")}, infl("direct/useful", "direct/useless"),
              units("direct/useful", "direct/useless")),
        Claim("iii", "pre-caching influence is positive for useless squares",
              f"useless {list(pc[('pre_cached', 'useless')])}, useful {list(pc[('pre_cached', 'useful')])}",
              interval_above("useless-square pre-caching influence", "pre_cached/useless"),
              {"pre_cached/useless": row["pre_cached/useless"]}, infl("pre_cached/useless", "pre_cached/useful"),
              units("pre_cached/useless")),
        Claim("iv", "shared (circuit-sharing) influence is positive for both useful and useless squares",
              f"useful {list(pc[('shared', 'useful')])}, useless {list(pc[('shared', 'useless')])}",
              every(interval_above("useful-square shared influence", "shared/useful"),
                    interval_above("useless-square shared influence", "shared/useless")),
              {k: row[k] for k in ("shared/useful", "shared/useless")}, infl("shared/useful", "shared/useless"),
              units("shared/useful", "shared/useless")),
    ]


# ---------------------------------------------------------------------------------------------------- figures


def _layer_colors(layers):
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    n = max(1, len(layers) - 1)
    return {k: cmap(0.05 + 0.85 * i / n) for i, k in enumerate(layers)}


def _fig_training(summary, figdir):
    import matplotlib

    ev, tr = summary["eval_curve"], summary["train_curve"]
    if not ev and not tr:
        return None
    with matplotlib.rc_context(RC):
        fig, axes = figure_grid(10.0, 3.8, 1, 2, left=0.8, right=0.2, top=0.55, bottom=0.9, wspace=0.8)
        a, b = axes[0]
        pts = [(r["step"], r["legal_acc"]) for r in ev if finite(r.get("legal_acc"))]
        a.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, color="#0072B2", label="legal-move accuracy")
        pts = [(r["step"], r["first_acc"]) for r in ev if finite(r.get("first_acc"))]
        a.plot([x for x, _ in pts], [y for _, y in pts], marker="s", ms=3, color="#E69F00",
               label="first-move accuracy")
        a.set_ylim(0, 1.02)
        a.set_xlabel("training step")
        a.set_ylabel("accuracy of the argmax (eval games)")
        a.set_title("legal-move accuracy")
        b.plot([r["step"] for r in tr], [r["loss"] for r in tr], color="#333333", lw=1, label="train loss")
        pts = [(r["step"], r["eval_loss"]) for r in ev if finite(r.get("eval_loss"))]
        b.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, color="#D55E00", label="eval loss")
        b.set_xlabel("training step")
        b.set_ylabel("cross-entropy (nats/token)")
        b.set_title("loss")
        h1, l1 = a.get_legend_handles_labels()
        h2, l2 = b.get_legend_handles_labels()
        finish_figure(fig, "Training: legal-move accuracy (share of predictions whose argmax is legal) and loss",
                      h1 + h2, l1 + l2, 4)
        return save_figure(fig, figdir, "training")


def _fig_probe_by_layer(summary, figdir):
    import matplotlib

    rows = summary["probe_by_layer"]
    if not rows:
        return None
    with matplotlib.rc_context(RC):
        fig, axes = figure_grid(10.5, 4.2, 1, 2, left=0.8, right=0.2, top=0.55, bottom=1.05, wspace=0.8)
        for ax, metric in zip(axes[0], METRICS):
            for typ in PROBE_TYPES:
                for w, ls in (("final", "-"), ("init", "--")):
                    sel = sorted((r for r in rows if r["metric"] == metric and r["weights"] == w and r["type"] == typ),
                                 key=lambda r: r["layer"])
                    if not sel:
                        continue
                    xs = [r["layer"] for r in sel]
                    if w == "final":
                        ci_band(ax, xs, sel, TYPE_COLORS[typ], bounds=METRIC_BOUNDS[metric])
                    ax.plot(xs, [r["mean"] for r in sel], ls=ls, marker="o" if w == "final" else None, ms=3,
                            color=TYPE_COLORS[typ], lw=1.6 if w == "final" else 1.1,
                            label=f"{typ} squares, {'trained' if w == 'final' else 'step 0 (baseline)'}")
            ax.set_xlabel("layer k (resid[0] = embeddings, resid[k] = output of block k−1)")
            ax.set_ylabel(METRICS[metric] + " (test games)")
            ax.set_xticks(summary["layers"])
            ax.set_title(METRICS[metric])
        h, lab = axes[0][0].get_legend_handles_labels()
        finish_figure(fig, "Probe quality by layer (mean over positions; bands: 95% t-CI over the 64 squares, clipped "
                      "to the metric's range)", h, lab, 3)
        return save_figure(fig, figdir, "probe_by_layer")


def _fig_probe_by_move(summary, figdir):
    import matplotlib

    rows = [r for r in summary["probe_grid"] if r["type"] == "all"]
    if not rows:
        return None
    layers = summary["layers"]
    colors = _layer_colors(layers)
    with matplotlib.rc_context(RC):
        fig, axes = figure_grid(11.0, 4.6, 1, 2, left=0.8, right=0.2, top=0.75, bottom=1.25, wspace=0.9)
        for ax, metric in zip(axes[0], METRICS):
            for k in layers:
                for w, ls in (("final", "-"), ("init", ":")):
                    sel = sorted((r for r in rows if r["metric"] == metric and r["weights"] == w and r["layer"] == k),
                                 key=lambda r: r["pos"])
                    if sel:
                        ax.plot([r["pos"] for r in sel], [r["mean"] for r in sel], ls=ls, color=colors[k],
                                lw=1.5 if w == "final" else 1.0,
                                label=f"layer {k}" if w == "final" else ("step 0 (dotted)" if k == layers[-1] else None))
            ax.set_xlabel("move index (position p, after reading move p)")
            ax.set_ylabel(METRICS[metric] + "\n(mean over the 64 squares)")
            ax.set_title(METRICS[metric])
        h, lab = axes[0][0].get_legend_handles_labels()
        finish_figure(fig, "Probe quality by move index, all squares\nsolid = trained, dotted = step-0 baseline "
                      "(same colour per layer)", h, lab, min(len(lab), 8))
        return save_figure(fig, figdir, "probe_by_move")


def _fig_gap(summary, figdir):
    import matplotlib

    gl, gg = summary["gap_by_layer"], summary["gap_grid"]
    if not gl:
        return None
    layers = summary["layers"]
    colors = _layer_colors(layers)
    with matplotlib.rc_context(RC):
        fig, axes = figure_grid(11.4, 7.6, 2, 2, left=1.15, right=0.2, top=0.6, bottom=1.2, wspace=1.05, hspace=0.75)
        for i, metric in enumerate(METRICS):
            a, b = axes[i]
            for w, ls, color in (("final", "-", TRAINED_COLOR), ("init", "--", BASELINE_COLOR)):
                sel = sorted((r for r in gl if r["metric"] == metric and r["weights"] == w), key=lambda r: r["layer"])
                if sel:
                    xs = [r["layer"] for r in sel]
                    if w == "final":  # the step-0 line has no band: one band per panel, never two greys
                        ci_band(a, xs, sel, color, alpha=0.25)
                    a.plot(xs, [r["mean"] for r in sel], ls=ls, marker="o", ms=3, color=color,
                           label="trained (band: 95% t-CI over squares)" if w == "final" else STEP0_LABEL)
            a.axhline(0, color="#000000", lw=0.6)
            a.set_xticks(layers)
            a.set_xlabel("layer k")
            a.set_ylabel(f"useful − useless\n({METRICS[metric]})")
            a.set_title(f"gap by layer ({'r' if metric == 'r' else 'accuracy'}; mean over positions, 95% CI over squares)",
                        fontsize=9)
            for k in [k for k in layers if k >= 1]:
                sel = sorted((r for r in gg if r["metric"] == metric and r["weights"] == "final" and r["layer"] == k),
                             key=lambda r: r["pos"])
                if sel:
                    b.plot([r["pos"] for r in sel], [r["mean"] for r in sel], color=colors[k], lw=1.4,
                           label=f"layer {k} (trained)")
            base = sorted((r for r in summary["gap_by_pos"] if r["metric"] == metric and r["weights"] == "init"),
                          key=lambda r: r["pos"])
            if base:
                b.plot([r["pos"] for r in base], [r["mean"] for r in base], ls="--", color=BASELINE_COLOR, lw=1.4,
                       label=STEP0_LABEL)
            b.axhline(0, color="#000000", lw=0.6)
            b.set_xlabel("move index (position p)")
            b.set_ylabel(f"useful − useless\n({METRICS[metric]})")
            b.set_title("gap by move index (mean over the 64 squares)", fontsize=9)
        h1, l1 = axes[0][0].get_legend_handles_labels()
        h2, l2 = axes[0][1].get_legend_handles_labels()
        finish_figure(fig, "Paper Fig. 3: probe-quality gap between NTP-useful and NTP-useless squares",
                      h1 + h2, l1 + l2, min(len(l1 + l2), 5))
        return save_figure(fig, figdir, "gap")


def _fig_influence_bars(summary, figdir):
    import matplotlib

    infl = summary["influence"]
    if not any(infl[f"{c}/{t}"]["n"] for c in COMPONENTS for t in ("useful", "useless")):
        return None
    with matplotlib.rc_context(RC):
        fig, axes = figure_grid(11.0, 4.6, 1, 2, left=0.95, right=0.2, top=0.85, bottom=0.9, wspace=0.95)
        width = 0.38
        for ax, source in zip(axes[0], ("ours", "paper")):
            for j, t in enumerate(("useful", "useless")):
                xs, means, err = [], [], [[], []]
                for i, c in enumerate(COMPONENTS):
                    x = i + (j - 0.5) * width
                    if source == "ours":
                        s = infl[f"{c}/{t}"]
                        if s["mean"] is None:
                            continue
                        m, lo, hi = s["mean"], s["lo"], s["hi"]
                    else:
                        lo, hi = PAPER_CI[(c, t)]
                        m = 0.5 * (lo + hi)
                    xs.append(x)
                    means.append(m)
                    err[0].append(m - lo if lo is not None else 0.0)
                    err[1].append(hi - m if hi is not None else 0.0)
                ax.bar(xs, means, width=width * 0.92, color=TYPE_COLORS[t], label=f"{t} squares", edgecolor="white",
                       hatch=None if source == "ours" else "//", alpha=1.0 if source == "ours" else 0.55)
                ax.errorbar(xs, means, yerr=err, fmt="none", ecolor="#000000", capsize=2.5, elinewidth=1)
            ax.axhline(0, color="#000000", lw=0.6)
            ax.set_xticks(range(len(COMPONENTS)), [COMPONENT_LABELS[c] for c in COMPONENTS])
            ax.grid(axis="x", visible=False)
            ax.set_ylabel("integrated Adam influence\n(+ = toward final value)")
            ax.set_title("this run: mean, 95% t-CI over square × position × layer" if source == "ours" else
                         "paper (docs/paper.md#numbers): CI midpoint and 95% CI; unit unknown", fontsize=9)
        h, lab = axes[0][0].get_legend_handles_labels()
        finish_figure(fig, f"Integrated influence on the central squares by type (Adam variant).\n{SIGN}", h, lab, 2)
        return save_figure(fig, figdir, "influence_bars")


def _fig_influence_curves(summary, figdir):
    import matplotlib

    rows = summary["influence_curves"]
    if not rows:
        return None
    with matplotlib.rc_context(RC):
        fig, axes = figure_grid(11.0, 4.3, 1, 2, left=0.95, right=0.2, top=0.85, bottom=0.95, wspace=0.4)
        axes[0][1].sharey(axes[0][0])
        for ax, t in zip(axes[0], ("useful", "useless")):
            for c in COMPONENTS:
                sel = sorted((r for r in rows if r["type"] == t and r["component"] == c), key=lambda r: r["step"])
                if sel:
                    ax.plot([r["step"] for r in sel], [r["mean_cumulative"] for r in sel],
                            color=COMPONENT_COLORS[c], lw=1.2 if c == "full" else 1.8, ls="--" if c == "full" else "-",
                            label=COMPONENT_LABELS[c])
            ax.axhline(0, color="#000000", lw=0.6)
            ax.set_xlabel("training step")
            ax.set_title(f"{t} squares")
        axes[0][0].set_ylabel("cumulative influence (mean over units)\n+ = toward final value")
        h, lab = axes[0][0].get_legend_handles_labels()
        finish_figure(fig, f"Cumulative Adam influence over training.\n{SIGN}", h, lab, len(lab))
        return save_figure(fig, figdir, "influence_curves")


def make_figures(summary: dict, figdir: Path) -> dict[str, bytes]:
    """Draw every figure that has data; returns {name: PNG bytes}."""
    return draw_figures(summary, figdir, {"training": _fig_training, "probe_by_layer": _fig_probe_by_layer,
                                          "probe_by_move": _fig_probe_by_move, "gap": _fig_gap,
                                          "influence_bars": _fig_influence_bars,
                                          "influence_curves": _fig_influence_curves})


# ---------------------------------------------------------------------------------------------------- document


def _document(summary: dict, figures) -> list[tuple]:
    sc = summary["scale"]
    cfg = summary["config"]
    b = [("h1", "OthelloGPT: useful and useless squares (docs/paper.md#othello, claim 3)")]
    size = (f"{cfg.get('n_layer')} layers, d_model {cfg.get('d_model')}, {cfg.get('n_head')} heads, "
            f"{summary['n_params']} parameters; {cfg.get('steps')} steps at batch {cfg.get('batch_size')}, lr "
            f"{cfg.get('lr')}, {cfg.get('n_train')} training games, {cfg.get('n_eval')} eval games; seed "
            f"{summary['seed']}")
    if sc == "paper":
        scale_text = f"Scale: paper ({size})."
    else:
        scale_text = (f"Scale: {sc} ({size}). This is NOT the paper's setting (6 layers, d_model 256, batch 1024, "
                      "5000 steps); absolute numbers are not comparable with the paper and the verdicts describe this "
                      "small run only.")
    b.append(("p", (f"{scale_text} One training run, so every interval is over squares (probe quality) or over "
                    f"square × position × layer units (influence), not over seeds. {SIGN} Every number below is also "
                    "in summary.json.")))

    b.append(("h2", "Scale and settings"))
    b.append(("table", ["setting", "this run", "paper", "differs"],
              [[s["setting"], s["this_run"], s["paper"], "yes" if s["differs"] else ""] for s in summary["settings"]],
              None))
    t, st = summary["timings"], summary["step_times"]
    if t:
        parts = [f"{k} {v:.0f} s" for k, v in sorted(t.items())]
        extra = []
        if "train_s_per_step" in st:
            extra.append(f"training {st['train_s_per_step']:.3g} s/step (incl. evaluations)")
        if "tracked_s_per_step" in st:
            extra.append(f"tracked replay {st['tracked_s_per_step']:.3g} s/step")
        b.append(("p", "Measured wall time of the stages that ran (this machine): " + ", ".join(parts)
                  + (". Per step: " + "; ".join(extra) if extra else "") + "."))

    b.append(("h2", "Claims"))
    b.append(("claims", [c.to_dict() for c in claims(summary)], False))
    b.append(("p", "Each rule's text and the code that applies it come from the same Claim (othello_report.claims); "
                   "a claim whose preconditions fail at this scale is 'not testable at this scale'."))

    b.append(("h2", "Legal-move accuracy"))
    r = summary["run"]
    b.append(("p", (f"Final legal-move accuracy of the argmax prediction on the eval games: "
                    f"{fmt(r.get('legal_acc'))} (share of the 60 predictions per game whose argmax is a legal next "
                    f"token, averaged over games); first move {fmt(r.get('first_acc'))}; eval loss "
                    f"{fmt(r.get('eval_loss'))} nats/token.")))
    b.append(("fig", "training",
                  "Legal-move accuracy and first-move accuracy over training (eval games) and the loss."))

    b.append(("h2", "Probe quality"))
    b.append(("p", ("Ridge probes (alpha 1, Pearson r of the ternary square value) and a 3-way least-squares "
                    "linear classifier (ridge on the one-hot class empty/own/opponent, argmax) per layer × position, "
                    "fitted on the first 70% of the eval games and scored on the last 30%. 'useless' / 'useful': the "
                    "test rows where the square is an NTP-useless / NTP-useful stone (per example). The step-0 "
                    "(untrained) model is the baseline in every probe figure.")))
    b.append(("fig", "probe_by_layer",
                  "Probe quality by layer for all, useless and useful squares; solid: trained, dashed: step 0. "
                  "Bands: 95% t-CI over the 64 squares of each square's mean over positions, clipped to the "
                  "metric's range ([−1, 1] for r, [0, 1] for accuracy)."))
    b.append(("fig", "probe_by_move",
                  "Probe quality by move index for each layer (all squares, mean over the 64 squares); solid: "
                  "trained, dotted: step 0."))
    rows = []
    for k in summary["layers"]:
        cells = [str(k)]
        for metric in METRICS:
            for typ in PROBE_TYPES:
                for w in ("final", "init"):
                    s = next((x for x in summary["probe_by_layer"] if x["metric"] == metric and x["type"] == typ
                              and x["weights"] == w and x["layer"] == k), None)
                    cells.append(fmt(s["mean"]) if s else "n/a")
        rows.append(cells)
    header = ["layer"] + [f"{'r' if m == 'r' else 'acc'} {t} {'trained' if w == 'final' else 'step 0'}"
                          for m in METRICS for t in PROBE_TYPES for w in ("final", "init")]
    b.append(("table", header, rows, None))

    b.append(("h2", "Fig. 3: the useful − useless gap"))
    b.append(("fig", "gap",
                  "Gap r(useful) − r(useless) (top) and accuracy(useful) − accuracy(useless) (bottom), by layer (left; "
                  "mean over positions, 95% t-CI over squares; dashed: step 0) and by move index (right; one line per layer "
                  "≥ 1; dashed: step 0 averaged over layers ≥ 1)."))
    rows = []
    for g in summary["gap_by_layer"]:
        rows.append([METRICS[g["metric"]], "trained" if g["weights"] == "final" else "step 0", str(g["layer"]),
                     fmt_ci(g), str(g["n"])])
    b.append(("table", ["metric", "weights", "layer", "gap (95% CI over squares)", "n squares"], rows, None))
    rows = [[k.split("/")[0], k.split("/")[1], fmt_ci(v["per_layer"], fmt_g), fmt_ci(v["per_move"], fmt_g),
             fmt_ci(v["mean_layers_ge1"])] for k, v in summary["gap_slopes"].items()]
    b.append(("table", ["metric", "weights", "slope per layer", "slope per move", "mean gap, layers ≥ 1"], rows,
              None))

    b.append(("h2", "Integrated influence"))
    b.append(("p", (f"Integrated Adam influence (sum over all {cfg.get('steps')} training steps) of each gradient "
                    "component on the tracked central squares, with the risk of each square restricted to the batch "
                    "rows where it is useful / useless (per-type risks, as the reference). Unit of the CI: one "
                    "square × position × layer whose type occurred in training (tracked sites: "
                    f"{_sites_text(summary['sites'])}). Value unit: {INFLUENCE_UNIT}. {SIGN} The paper's intervals "
                    "(docs/paper.md#numbers, unit unknown) are beside ours; only signs and which CIs exclude 0 are "
                    "comparable, not magnitudes.")))
    rows = []
    for c in COMPONENTS:
        u, s = summary["influence"][f"{c}/useful"], summary["influence"][f"{c}/useless"]
        pu, ps = PAPER_CI[(c, "useful")], PAPER_CI[(c, "useless")]
        rows.append([COMPONENT_LABELS[c], fmt_ci(u, fmt_g), f"[{pu[0]}, {pu[1]}]", fmt_ci(s, fmt_g),
                     f"[{ps[0]}, {ps[1]}]", f"{u['n']} / {s['n']}"])
    b.append(("table", ["component (+ = toward final value)", "useful (ours)", "useful (paper)", "useless (ours)",
                        "useless (paper)", "n units useful / useless"], rows, "influence"))
    b.append(("fig", "influence_bars",
                  f"Integrated influence by component and square type: ours (left) and the paper's (right). "
                  f"{SIGN}"))
    b.append(("fig", "influence_curves", f"Cumulative influence over training, mean over units, by component. {SIGN}"))
    rows = [[str(r["layer"]), str(r["pos"]), COMPONENT_LABELS[r["component"]], r["type"], fmt_ci(r, fmt_g), str(r["n"])]
            for r in summary["influence_by_site"]]
    if rows:
        b.append(("p", "Per tracked site (95% t-CI over the squares of that site):"))
        b.append(("table", ["layer", "position", "component", "type", "integrated influence", "n squares"], rows,
                  None))
    sn = summary["sanity"]
    if sn["adam_full"]["n"]:
        full, removed = sn["adam_full"]["mean"], sn["R0_minus_RT_eval"]["mean"]
        ratio = f"{full / removed:.3g}" if finite(full) and finite(removed) and removed != 0 else "n/a"
        b.append(("p", ("Sanity check (whole-batch risks, per tracked square): mean integrated full Adam influence "
                        f"{fmt_ci(sn['adam_full'], fmt_g)} vs mean mismatch actually removed on held-out games "
                        f"R(θ0) − R(θT) {fmt_ci(sn['R0_minus_RT_eval'], fmt_g)}; ratio {ratio}. The two agree only to "
                        "first order in the step size (docs/paper.md#influence): a ratio far from 1 means the per-step "
                        "linearisation misses curvature, and the integrated influences then indicate the direction "
                        "of each component's push more reliably than its size.")))
    return b


# ---------------------------------------------------------------------------------------------------- entry point


def write_report(out_dir: str | Path) -> Path:
    """Read ``out_dir/data.json``; write figures/, summary.json, report.md and report.html. Returns report.md's path."""
    return write_from_data(out_dir, summarize, make_figures, _document)


def main(argv=None) -> None:
    """Command line: write the report of the folder OUT holding data.json and print the report.md path."""
    report_main("othello_report", "OthelloGPT", write_report, argv)


if __name__ == "__main__":
    main()
