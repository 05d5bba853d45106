"""Report of the OthelloGPT reproduction (docs/paper.md#othello, claim 3) from ``OUT/data.json``.

``write_report(out_dir)`` reads ``out_dir/data.json`` (``ntpflow.experiments.othello.run_othello``; schema in
docs/outputs.md) and writes ``figures/``, ``summary.json``, ``report.md`` and ``report.html``. Layers: ``resid[k]``
= output of block k − 1 (docs/conventions.md); position ``p`` = after reading move ``p``. Statistics: one training
run (seed 0), so the units are squares (probe quality: a 95% t-interval over the 64 squares of each square's mean
over the cells shown) and square × position × layer (influence: the tracked units whose per-type risk was defined).
Sign convention: positive influence = the component moved the feature toward its final value.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from ntpflow.experiments import figure_style as fs
from ntpflow.experiments.claim_registry import (
    FRAGILITY_METRIC,
    OPTIMIZER_NAMES,
    PAPER_CI,
    account_text,
    othello_claims,
    othello_fragility_claims,
    othello_influence_checks,
)
from ntpflow.experiments.formats import (
    mismatch_summary,
    plain_number,
    read_at_settings,
    select,
    sites_text,
)
from ntpflow.experiments.render import report_main, template_blocks, write_from_data
from ntpflow.replay.summary import residual_share
from ntpflow.stats import finite, mean_of, slope, stat_rows, stats

COMPONENTS = ("direct", "pre_cached", "shared", "full")
COMPONENT_LABELS = {"direct": "direct", "pre_cached": "pre-caching", "shared": "shared", "full": "combined"}
TYPE_COLORS = fs.TYPE_COLORS
PROBE_TYPES = ("all", "useless", "useful")
METRICS = {"r": "ridge probe Pearson r", "acc": "3-way classifier accuracy"}
TRAINED_COLOR = fs.REGIME_COLORS["vanilla"]  # the Othello model is trained vanilla
STEP0_LABEL = "step 0 (untrained baseline; right: mean over layers ≥ 1)"
METRIC_BOUNDS = {"r": (-1.0, 1.0), "acc": (0.0, 1.0)}

SIGN = "Sign convention: positive = the component moved the feature toward its final value."
INFLUENCE_UNIT = ("probe units² (the decrease of the squared probe mismatch R that the component caused, summed over "
                  "steps)")
PAPER_SETTINGS = {"n_layer": "6", "d_model": "256", "n_head": "4", "batch_size": "1024", "steps": "5000",
                  "lr": "0.001", "n_train": "unknown (pre-generated)", "n_eval": "20480",
                  "sites": "layers 1–6 × positions 4, 8, …, 56", "squares": "16 central (C3–F6)",
                  "lr schedule": "constant", "games seen": "5120000",
                  "readout": "none (each step's own batch)"}
SETTING_KEYS = ("n_layer", "d_model", "n_head", "batch_size", "steps", "lr", "n_train", "n_eval")


class _Probes:
    """The per-square probe values by (weights, metric, type, layer, pos); the type "gap" is useful − useless."""

    def __init__(self, records):
        self.v = {(r["weights"], r["metric"], r["type"], r["layer"], r["pos"]): r["values"] for r in records}
        self.layers = sorted({r["layer"] for r in records})
        self.positions = sorted({r["pos"] for r in records})
        self.n_sq = max((len(r["values"]) for r in records), default=0)

    def get(self, weights, metric, typ, layer, pos):
        """One value per square (None where undefined), or None without data."""
        if typ != "gap":
            return self.v.get((weights, metric, typ, layer, pos))
        u, s = (self.v.get((weights, metric, t, layer, pos)) for t in ("useful", "useless"))
        if u is None or s is None:
            return None
        return [a - b if finite(a) and finite(b) else None for a, b in zip(u, s)]

    def per_square(self, weights, metric, typ, cells):
        """For each square, the mean of its values over ``cells`` [(layer, pos)]."""
        values = [self.get(weights, metric, typ, k, p) or [None] * self.n_sq for k, p in cells]
        return [mean_of(v[j] for v in values) for j in range(self.n_sq)]


def summarize(data: dict) -> dict:
    """Every aggregate of the report and the claims table from the parsed data.json (pure, no I/O)."""
    pr = _Probes(data.get("probes") or [])
    layers, positions = pr.layers, pr.positions
    by_layer, by_pos, grid, gap_slopes = _probe_quality(pr, data.get("probes") or [])

    # ---- integrated influence table
    influence = [r for r in data.get("influence") or [] if r["component"] in COMPONENTS]
    table = {f"{c}/{t}": {**stats(r["total"] for r in select(influence, component=c, type=t)),
                          "paper": list(PAPER_CI[(c, t)]) if (c, t) in PAPER_CI else None}
             for c in COMPONENTS for t in ("useful", "useless", "all")}
    sgd = [r for r in data.get("influence_sgd") or [] if r["component"] in COMPONENTS]
    table_sgd = {f"{c}/{t}": stats(r["total"] for r in select(sgd, component=c, type=t))["mean"]
                 for c in COMPONENTS for t in ("useful", "useless")} if sgd else {}
    per_site = stat_rows([r for r in influence if r["type"] in ("useful", "useless")],
                         ("layer", "pos", "component", "type"), "total")

    # ---- R_c and R per site × square type, mean over the tracked squares; held-out numbers (R removed, offset share)
    # are of whole-batch ("all") risks only; before R_c, the records are data.json's sanity rows
    records = data.get("mismatch") or [{**r, "mismatch": "paper"} for r in data.get("sanity") or []]
    by_mismatch = mismatch_summary([r for r in influence if r["type"] in PROBE_TYPES], [
        r for r in data.get("influence_centred") or [] if r["type"] in PROBE_TYPES],
        [{**r, "type": "all"} for r in records], ("layer", "pos", "type"))

    curves = [r for r in data.get("curves") or [] if r["type"] in ("useful", "useless")
              and r["component"] in COMPONENTS]
    sanity = data.get("sanity") or []
    sanity_s = {"R0_minus_RT_eval": stats(r["R0_minus_RT_eval"] for r in sanity),
                "adam_full": stats(r["adam_full"] for r in sanity)}

    run = data.get("run") or {}
    timings = data.get("timings") or {}
    cfg = data.get("config") or {}
    kept = bool(data.get("account_kept"))  # the vanilla run kept the exact account while training (no replay)

    summary = {
        "scale": data.get("scale"), "scale_note": data.get("scale_note", ""), "seed": data.get("seed"),
        "config": cfg, "n_params": data.get("n_params"), "sites": data.get("sites") or [],
        "squares": data.get("squares") or [], "settings": _settings(data), "timings": timings,
        "step_times": _step_times(timings, cfg.get("steps"), kept), "sign_convention": SIGN,
        "influence_unit": INFLUENCE_UNIT,
        "ci": ("two-sided 95% Student-t intervals; probe quality over squares (n ≤ 64), influence over units "
               "square × position × layer; lo/hi null when n < 2"),
        "run": {k: run.get(k) for k in ("legal_acc", "first_acc", "eval_loss")},
        "eval_curve": data.get("eval_curve") or [], "train_curve": data.get("train_curve") or [],
        "layers": layers, "positions": positions,
        "probe_by_layer": _split(by_layer, False), "probe_by_pos": _split(by_pos, False),
        "probe_grid": _split(grid, False), "gap_by_layer": _split(by_layer, True), "gap_by_pos": _split(by_pos, True),
        "gap_grid": _split(grid, True), "gap_slopes": gap_slopes,
        "influence": table, "influence_sgd": table_sgd, "optimizer": data.get("optimizer", "adam"),
        "readout": data.get("readout"),
        "influence_by_site": per_site, "influence_curves": curves, "sanity": sanity_s,
        "exact_account": residual_share(r for r in records if r["mismatch"] == "paper"),
        **by_mismatch,
    }
    summary["claims"] = [c.to_dict() for c in othello_claims(summary)]
    summary["fragility"] = _fragility(data.get("fragility"), summary)
    summary["cpu_time"] = _cpu_time(timings, cfg.get("steps"), kept)
    summary["pilots"] = data.get("pilots") or ""
    summary["pilots_repo"] = posixpath.normpath(f"docs/results/othello-{summary['scale']}/{summary['pilots']}")
    summary["n_squares"] = len(data.get("feature_names") or []) or 64
    return summary


STAGES = {"train": "training (vanilla)", "train_myopic": "training (myopic)", "probes_final": "ridge probes (trained)",
          "probes_init": "ridge probes (step 0)", "classifier_final": "classifier (trained)",
          "classifier_init": "classifier (step 0)", "probes_myopic": "ridge probes (myopic)",
          "fragility": "fragility test", "attribution": "tracked replay"}


def _cpu_time(timings: dict, steps: int | None = None, kept: bool = False) -> dict:
    """Per stage of :data:`STAGES` the CPU seconds recorded (``timings["cpu_s"]``), else the wall seconds (stages
    timed before CPU times were recorded), else nothing; and the total CPU hours of the stages with a CPU record. A
    training timed over fewer than its ``steps`` (resumed after a call cut off) says over how many; ``kept``: the
    influence stage read the account kept while training (no replay).
    ``{"stages": [{stage, label, cpu_s, wall_s}], "total_cpu_h", "missing": [labels]}``."""
    cpu, timed = timings.get("cpu_s") or {}, timings.get("steps") or {}

    def label(k: str) -> str:
        if kept and k == "attribution":
            return "influence (read from the account kept while training)"
        name = "training (vanilla, with the account)" if kept and k == "train" else STAGES[k]
        part = timed.get(k)
        return name + (f", the last {part} of {steps} steps" if part is not None and steps and part < steps else "")

    rows = [{"stage": k, "label": label(k), "cpu_s": cpu.get(k), "wall_s": timings.get(k)} for k in STAGES
            if finite(cpu.get(k)) or finite(timings.get(k))]
    return {"stages": rows, "total_cpu_h": sum(r["cpu_s"] for r in rows if finite(r["cpu_s"])) / 3600,
            "missing": [label(k) for k in STAGES if not finite(cpu.get(k)) and not finite(timings.get(k))]}


def _fragility(record: dict | None, summary: dict) -> dict | None:
    """The fragility section: the rows of each regime (measure's, with the regime), the comparisons, the counts and
    the two predictions as claims (``claim_registry.othello_fragility_claims``; the myopic model's gates from its
    legal-move accuracy and useful squares' ridge r in the record); None before the test."""
    if not record:
        return None
    my = record.get("myopic") or {}
    fragility = {**{k: record.get(k) for k in ("t", "t0", "depth", "n_games", "seed", "n_boot", "pairs",
                                               "mean_differing_stones")},
                 "rows": [{"regime": regime, **r} for regime, rows in (record.get("rows") or {}).items()
                          for r in rows],
                 "comparisons": record.get("comparisons") or [], "metric": FRAGILITY_METRIC,
                 "myopic_legal_acc": my.get("legal_acc"),
                 "myopic_useful_r_by_layer": [{"layer": r["layer"], "mean": r["mean"]}
                                              for r in my.get("useful_r_by_layer") or []]}
    return {**fragility, "claims": _fragility_claims(fragility, summary)}


def _fragility_claims(fragility: dict, summary: dict) -> list[dict]:
    """The fragility predictions judged on the report's fragility section (its comparisons, pair counts and the
    myopic model's legal-move accuracy and useful squares' ridge r by layer) and the vanilla summary's gates."""
    myopic = {"run": {"legal_acc": fragility.get("myopic_legal_acc")},
              "probe_by_layer": [{"metric": "r", "weights": "final", "type": "useful", **r}
                                 for r in fragility.get("myopic_useful_r_by_layer") or []]}
    return [c.to_dict() for c in othello_fragility_claims(fragility, summary, myopic)]


def _probe_quality(pr: _Probes, probes: list[dict]) -> tuple[list, list, list, dict]:
    """``(by_layer, by_pos, grid, gap_slopes)``: the probe quality per type and Fig. 3's gap useful − useless, by
    layer (mean over positions), by move (mean over layers ≥ 1) and per (layer, move); per square, then stats over
    squares; and the slopes of the gap over layers and moves."""
    layers, positions = pr.layers, pr.positions
    upper = [k for k in layers if k >= 1]
    weights_present = sorted({r["weights"] for r in probes}, key=lambda w: w != "final")
    by_layer, by_pos, grid, gap_slopes = [], [], [], {}
    for metric in METRICS:
        for w in weights_present:
            for typ in (*PROBE_TYPES, "gap"):
                key = {"metric": metric, "weights": w, "type": typ}
                per_layer = {k: pr.per_square(w, metric, typ, [(k, p) for p in positions]) for k in layers}
                for k in layers:
                    if (s := stats(per_layer[k]))["n"]:
                        by_layer.append({**key, "layer": k, **s})
                    for p in positions:
                        if (m := mean_of(pr.get(w, metric, typ, k, p) or [])) is not None:
                            grid.append({**key, "layer": k, "pos": p, "mean": m})
                per_pos = {p: pr.per_square(w, metric, typ, [(k, p) for k in upper]) for p in positions}
                by_pos += [{**key, "pos": p, **s} for p in positions if (s := stats(per_pos[p]))["n"]]
            squares = range(pr.n_sq)  # per_layer, per_pos: of the gap, the last type
            gap_slopes[f"{metric}/{w}"] = {
                "per_layer": stats(slope(upper, [per_layer[k][j] for k in upper]) for j in squares),
                "per_move": stats(slope(positions, [per_pos[p][j] for p in positions]) for j in squares),
                "mean_layers_ge1": stats(mean_of(per_layer[k][j] for k in upper) for j in squares)}
    return by_layer, by_pos, grid, gap_slopes


def _split(rows: list[dict], gap: bool) -> list[dict]:
    """The probe-quality rows, or the gap rows without their type."""
    return [{k: v for k, v in r.items() if k != "type"} if gap else r for r in rows if (r["type"] == "gap") == gap]


def _step_times(timings: dict, steps: int | None, kept: bool = False) -> dict:
    """Seconds per training step (over the steps the training stage timed, all ``steps`` when it does not say) and,
    for a replay (not ``kept``: the account kept while training), per tracked step, from the stage timings."""
    step_times = {}
    trained = (timings.get("steps") or {}).get("train", steps)
    if trained and finite(timings.get("train")):
        step_times["train_s_per_step"] = timings["train"] / trained
        step_times["train_includes"] = "evaluations and the exact account" if kept else "evaluations"
    if steps and finite(timings.get("attribution")) and not kept:
        step_times["tracked_s_per_step"] = timings["attribution"] / steps
    return step_times


def _schedule(cfg: dict) -> str:
    """The learning-rate schedule of a config in words ("constant" without warmup or decay)."""
    parts = [f"{cfg['warmup']}-step linear warmup"] if cfg.get("warmup") else []
    if cfg.get("decay") not in (None, "", "none"):
        parts.append(f"{cfg['decay']} decay to {plain_number(cfg.get('final_lr_frac', 0.0))} × lr")
    return ", ".join(parts) or "constant"


def _settings(data: dict) -> list[dict]:
    cfg = data.get("config") or {}
    rows = [{"setting": "scale", "this_run": f"{data.get('scale', '?')} ({data.get('scale_note', '')})",
             "paper": "paper", "differs": data.get("scale") != "paper"}]
    for k in SETTING_KEYS:
        v = plain_number(cfg.get(k, "?"))
        rows.append({"setting": k, "this_run": v, "paper": PAPER_SETTINGS[k], "differs": v != PAPER_SETTINGS[k]})
    sites = sites_text(data.get("sites") or [])
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
    rows.append({"setting": "lr schedule", "this_run": _schedule(cfg), "paper": PAPER_SETTINGS["lr schedule"]})
    games = cfg.get("steps", 0) * cfg.get("batch_size", 0)
    epochs = f" ({games / cfg['n_train']:.3g} × the training set)" if cfg.get("n_train") else ""
    rows.append({"setting": "games seen (steps × batch)", "this_run": f"{games}{epochs}",
                 "paper": PAPER_SETTINGS["games seen"]})
    if data.get("readout") is not None:
        rows.append({"setting": "readout (exact account)", "this_run": f"the first {data['readout']} eval games",
                     "paper": PAPER_SETTINGS["readout"]})
    return [r if "differs" in r else {**r, "differs": r["this_run"] != r["paper"]}
            for r in rows + read_at_settings(data)]


# ---------------------------------------------------------------------------------------------------- figures


def _layer_colors(layers):
    return dict(zip(layers, fs.ordered_colors(len(layers))))


def _fig_training(summary):
    ev, tr = summary["eval_curve"], summary["train_curve"]
    if not ev and not tr:
        return None
    fig, axes = fs.figure(10.0, 3.8, 1, 2)
    a, b = axes[0]
    for ax, key, marker, color, label in ((a, "legal_acc", "o", "#000000", "legal-move accuracy"),
                                          (a, "first_acc", "s", fs.BASELINE, "first-move accuracy")):
        pts = [(r["step"], r[key]) for r in ev if finite(r.get(key))]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, ms=3, color=color, label=label)
    a.set_ylim(0, 1.02)
    a.set_xlabel("training step")
    a.set_ylabel("accuracy of the argmax (eval games)")
    a.set_title("legal-move accuracy")
    b.plot([r["step"] for r in tr], [r["loss"] for r in tr], color=fs.BASELINE, lw=1, label="train loss")
    pts = [(r["step"], r["eval_loss"]) for r in ev if finite(r.get("eval_loss"))]
    b.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, color="#000000", label="eval loss")
    b.set_xlabel("training step")
    b.set_ylabel("cross-entropy (nats/token)")
    b.set_title("loss")
    fs.finish(fig, "Training: legal-move accuracy (share of predictions whose argmax is legal) and loss", ncol=4)
    return fig


def _fig_probe_by_layer(summary):
    if not (rows := summary["probe_by_layer"]):
        return None
    fig, axes = fs.figure(10.5, 4.2, 1, 2)
    for ax, metric in zip(axes[0], METRICS):
        for typ in PROBE_TYPES:
            for w, ls in (("final", "-"), ("init", "--")):
                fs.mean_line(ax, select(rows, "layer", metric=metric, weights=w, type=typ), "layer", TYPE_COLORS[typ],
                             band=w == "final", bounds=METRIC_BOUNDS[metric], ls=ls,
                             marker="o" if w == "final" else None, ms=3, lw=1.6 if w == "final" else 1.1,
                             label=f"{typ} squares, {'trained' if w == 'final' else 'step 0 (baseline)'}")
        ax.set_xlabel("layer k (resid[0] = embeddings, resid[k] = output of block k−1)")
        ax.set_ylabel(METRICS[metric] + " (test games)")
        ax.set_xticks(summary["layers"])
        ax.set_title(METRICS[metric])
    fs.finish(fig, f"Probe quality by layer (mean over positions; bands: 95% t-CI over the {summary['n_squares']} "
                   "squares, clipped to the metric's range)", ncol=3)
    return fig


def _fig_probe_by_move(summary):
    if not (rows := select(summary["probe_grid"], type="all")):
        return None
    layers = summary["layers"]
    colors = _layer_colors(layers)
    fig, axes = fs.figure(11.0, 4.6, 1, 2)
    for ax, metric in zip(axes[0], METRICS):
        for k in layers:
            for w, ls in (("final", "-"), ("init", ":")):
                fs.mean_line(ax, select(rows, "pos", metric=metric, weights=w, layer=k), "pos", colors[k], ls=ls,
                             lw=1.5 if w == "final" else 1.0,
                             label=f"layer {k}" if w == "final" else ("step 0 (dotted)" if k == layers[-1] else None))
        ax.set_xlabel("move index (position p, after reading move p)")
        ax.set_ylabel(METRICS[metric] + f"\n(mean over the {summary['n_squares']} squares)")
        ax.set_title(METRICS[metric])
    fs.finish(fig, "Probe quality by move index, all squares\nsolid = trained, dotted = step-0 baseline "
                   "(same colour per layer)", ncol=8)
    return fig


def _fig_gap(summary):
    gl, gg = summary["gap_by_layer"], summary["gap_grid"]
    if not gl:
        return None
    layers = summary["layers"]
    colors = _layer_colors(layers)
    fig, axes = fs.figure(11.4, 7.6, 2, 2)
    for (a, b), metric in zip(axes, METRICS):
        # the step-0 line has no band: one band per panel, never two greys
        fs.mean_line(a, select(gl, "layer", metric=metric, weights="final"), "layer", TRAINED_COLOR, band=True,
                     band_alpha=0.25, marker="o", ms=3, label="trained (band: 95% t-CI over squares)")
        fs.mean_line(a, select(gl, "layer", metric=metric, weights="init"), "layer", fs.BASELINE, ls="--",
                     marker="o", ms=3, label=STEP0_LABEL)
        a.axhline(0, color="#000000", lw=0.6)
        a.set_xticks(layers)
        a.set_xlabel("layer k")
        a.set_ylabel(f"useful − useless\n({METRICS[metric]})")
        a.set_title(f"gap by layer ({'r' if metric == 'r' else 'accuracy'}; mean over positions, 95% CI over squares)",
                    fontsize=9)
        for k in [k for k in layers if k >= 1]:
            fs.mean_line(b, select(gg, "pos", metric=metric, weights="final", layer=k), "pos", colors[k], lw=1.4,
                         label=f"layer {k} (trained)")
        fs.mean_line(b, select(summary["gap_by_pos"], "pos", metric=metric, weights="init"), "pos", fs.BASELINE,
                     ls="--", lw=1.4, label=STEP0_LABEL)
        b.axhline(0, color="#000000", lw=0.6)
        b.set_xlabel("move index (position p)")
        b.set_ylabel(f"useful − useless\n({METRICS[metric]})")
        b.set_title(f"gap by move index (mean over the {summary['n_squares']} squares)", fontsize=9)
    fs.finish(fig, "Paper Fig. 3: probe-quality gap between NTP-useful and NTP-useless squares", ncol=5)
    return fig


def _fig_influence_bars(summary):
    """Ours (left): bars per component × square type with 95% t-CI whiskers, stating the account. The paper's
    (right, its own axis: second-hand 95% CIs of unknown unit): interval marks only, no bars, no midpoints."""
    infl = summary["influence"]
    if not any(infl[f"{c}/{t}"]["n"] for c in COMPONENTS for t in ("useful", "useless")):
        return None
    fig, axes = fs.figure(11.0, 4.6, 1, 2)
    ours, paper = axes[0]
    width = 0.38
    for j, t in enumerate(("useful", "useless")):
        xs = [i + (j - 0.5) * width for i in range(len(COMPONENTS))]
        rows = [infl[f"{c}/{t}"] for c in COMPONENTS]
        ours.bar([x for x, r in zip(xs, rows) if r["mean"] is not None], [r["mean"] for r in rows
                                                                           if r["mean"] is not None],
                 width=width * 0.92, color=TYPE_COLORS[t], label=f"{t} squares", edgecolor="white")
        fs.error_bars(ours, xs, rows)
        fs.paper_intervals(paper, xs, [PAPER_CI.get((c, t)) for c in COMPONENTS], color=TYPE_COLORS[t],
                           label=f"{t} squares (paper)")
    reading, checks = othello_influence_checks(summary)
    fs.account_note(ours, *account_text(reading, checks))
    for ax in (ours, paper):
        ax.axhline(0, color="#000000", lw=0.6)
        ax.set_xticks(range(len(COMPONENTS)), [COMPONENT_LABELS[c] for c in COMPONENTS])
        ax.grid(axis="x", visible=False)
    ours.set_ylabel("integrated Adam influence, this run\n(probe units²; + = toward final value)")
    paper.set_ylabel("the paper's 95% CI\n(second-hand; unit unknown)")
    ours.set_title("this run: mean, 95% t-CI over square × position × layer", fontsize=9)
    paper.set_title("paper (docs/paper.md#numbers): 95% CI only, on its own axis", fontsize=9)
    fs.finish(fig, f"Integrated influence on the central squares by type (Adam variant).\n{SIGN}", ncol=4)
    return fig


def _fig_influence_curves(summary):
    if not (rows := summary["influence_curves"]):
        return None
    fig, axes = fs.figure(11.0, 4.3, 1, 2)
    axes[0][1].sharey(axes[0][0])
    for ax, t in zip(axes[0], ("useful", "useless")):
        for c in COMPONENTS:
            sel = [{**r, "mean": r["mean_cumulative"]} for r in select(rows, "step", type=t, component=c)]
            fs.mean_line(ax, sel, "step", fs.COMPONENT_COLORS[c], lw=1.2 if c == "full" else 1.8,
                         ls="--" if c == "full" else "-", label=COMPONENT_LABELS[c])
        ax.axhline(0, color="#000000", lw=0.6)
        ax.set_xlabel("training step")
        ax.set_title(f"{t} squares")
    axes[0][0].set_ylabel("cumulative influence (mean over units)\n+ = toward final value")
    fs.account_note(axes[0][0], *account_text(*othello_influence_checks(summary)))
    fs.finish(fig, f"Cumulative Adam influence over training.\n{SIGN}", ncol=len(COMPONENTS))
    return fig


FIGURES = {"training": _fig_training, "probe_by_layer": _fig_probe_by_layer, "probe_by_move": _fig_probe_by_move,
           "gap": _fig_gap, "influence_bars": _fig_influence_bars, "influence_curves": _fig_influence_curves}


# ---------------------------------------------------------------------------------------------------- document


def _document(summary: dict, figures) -> list[tuple]:
    """The report's blocks; every claim judged again from the numbers, the fragility predictions too where the
    summary keeps the myopic model's ridge r by layer (summaries written before 2026-12-05 keep their own)."""
    if "myopic_useful_r_by_layer" in (summary.get("fragility") or {}):
        summary["fragility"]["claims"] = _fragility_claims(summary["fragility"], summary)
    return template_blocks("othello", [c.to_dict() for c in othello_claims(summary)], s=summary, sign=SIGN,
                           unit=INFLUENCE_UNIT, metrics=METRICS, types=PROBE_TYPES, components=COMPONENTS,
                           labels=COMPONENT_LABELS, paper_ci=PAPER_CI,
                           optimizer=OPTIMIZER_NAMES.get(summary.get("optimizer", "adam"), summary.get("optimizer")))


# ---------------------------------------------------------------------------------------------------- entry point


def write_report(out_dir: str | Path) -> Path:
    """Read ``out_dir/data.json``; write figures/, summary.json, report.md and report.html. Returns report.md's path."""
    return write_from_data(out_dir, summarize, FIGURES, _document)


if __name__ == "__main__":
    report_main("othello_report", "OthelloGPT", write_report)
