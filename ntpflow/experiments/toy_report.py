"""Report of the toy-task reproduction (docs/paper.md#majority, claims 1–2) from ``OUT/data.json``.

``write_report(out_dir)`` reads ``out_dir/data.json`` (written by ``ntpflow.experiments.toy.run_toy``) and writes

- ``figures/{probe_majority,probe_cond_majority,task_success,influence_curves,influence_bars}.{png,svg}``,
- ``summary.json``: every number the report shows (means, 95% t-interval bounds, n) and the claims table,
- ``report.md`` and ``report.html`` (self-contained: PNGs as base64 data URIs, inline CSS, claims table
  ``id="claims"``).

data.json schema: ``scale``, ``seeds``, ``sites`` ([[layer, pos], ...]), ``train`` (TrainConfig overrides),
``tracked`` ({task: [feature, ...]}), and tidy record lists

- ``runs``: {task, regime, seed, eval_loss, legal_acc, first_acc},
- ``probes``: {task, regime, seed, weights ("final" | "init"), layer, pos, feature, r (test Pearson r or null), useful},
- ``influence``: {task, regime, seed, layer, pos, feature, component, total, useful} (integrated Adam influence),
- ``curves``: {task, regime, seed, step, layer, pos, feature, component, cumulative}.

Sign convention: positive influence = the component moved the feature toward its final value.

Statistics: the unit of replication is the seed. Every interval is a two-sided 95% Student-t interval over seeds
(mean ± t_{0.975, n−1} · sd / √n); with one seed only the mean is given and verdicts that need a CI are
inconclusive.
All writes are atomic, and the same data.json gives byte-identical md/html/json (and, with the same matplotlib,
identical PNG/SVG).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import fields
from pathlib import Path

from ..config import REGIMES, TrainConfig
from .report_kit import (
    RC as _RC,
)
from .report_kit import (
    ci_band as _band,
)
from .report_kit import (
    figure_grid as _grid,
)
from .report_kit import (
    finish_figure as _finish,
)
from .report_kit import (
    finite as _finite,
)
from .report_kit import (
    fmt_ci as _ci,
)
from .report_kit import (
    fmt_g as _g,
)
from .report_kit import (
    has_ci as _has_ci,
)
from .report_kit import (
    mean_of as _mean,
)
from .report_kit import (
    plain_number as _plain,
)
from .report_kit import (
    report_main,
    stats,
    write_from_data,
)
from .report_kit import (
    save_figure as _save,
)
from .report_kit import (
    sites_text as _sites_text,
)

TASK_ORDER = ("majority", "cond_majority")
COMPONENTS = ("direct", "pre_cached", "shared")
ALL_COMPONENTS = COMPONENTS + ("full",)
COMPONENT_LABELS = {"direct": "direct", "pre_cached": "pre-cached", "shared": "shared", "full": "full (= sum)"}
# Okabe–Ito colours; regimes and components use disjoint sets and keep their colour in every figure
REGIME_COLORS = {"vanilla": "#0072B2", "myopic": "#D55E00", "untied": "#009E73", "myopic-untied": "#CC79A7"}
COMPONENT_COLORS = {"direct": "#E69F00", "pre_cached": "#56B4E9", "shared": "#6A3D9A", "full": "#333333"}
BASELINE_COLOR = "#7F7F7F"
EXTRA_COLORS = ("#999933", "#882255", "#44AA99", "#117733")  # regimes/components unknown to this module

# probed feature of each task (mean over the listed features) and the positions plotted
PROBE_FEATURES = {"majority": ("is_majority_<0>", "is_majority_<1>", "is_majority_<2>"),
                  "cond_majority": ("prev_is_<0>",)}
PROBE_POSITIONS = {"majority": tuple(range(1, 20)), "cond_majority": tuple(range(2, 20))}
FEATURE_TITLES = {"majority": "is_majority_<v> (mean over v = 0, 1, 2)", "cond_majority": "prev_is_<0>"}
TASK_TITLES = {"majority": "majority", "cond_majority": "conditioned majority"}
# window of the probe-gain claims: input positions (NTP-useless) and the layers after each block
CLAIM_LAYERS = (1, 2)
CLAIM_POSITIONS = tuple(range(2, 10))
B_THRESHOLD = 0.05  # claim b: a gain below this counts as "not learned"
C_RATIO = 0.25  # claim c: |direct| < C_RATIO * (pre_cached + shared) counts as "small"

SIGN = "Sign convention: positive influence = the component moved the feature toward its final value."
INFLUENCE_UNIT = "probe units² (first-order reduction of the squared probe mismatch)"

CLAIM_A = "myopic and untied each reduce the majority feature at input positions; myopic-untied reduces it most"
CLAIM_B = "a myopic model never learns prev_is_<0>"
CLAIM_C = ("in vanilla training the NTP-useless feature is driven by the pre-caching and shared parts, "
           "not the direct part")

RULE_A = ("Per seed, gain = final r − init r of the same seed (is_majority_<v>, mean over v), averaged over "
          "layers 1–2 and input positions 2–9; Δ = regime gain − vanilla gain, paired by seed; 95% t-CI over "
          "seeds. "
          "Reproduced if Δ(myopic) and Δ(untied) both have CI upper bound < 0 and myopic-untied has the lowest mean "
          "gain of the four regimes. Not reproduced if any Δ vs vanilla has CI lower bound > 0, or if myopic-untied "
          "is significantly above myopic or untied (paired CI lower bound > 0). Otherwise inconclusive (also with "
          "fewer than 2 seeds or a missing regime).")
RULE_B = ("Per seed, gain = final r − init r of prev_is_<0>, averaged over layers 1–2 and input positions 2–9; "
          "95% t-CI over seeds. Reproduced if vanilla's gain has CI lower bound > 0 and, for myopic and myopic-untied, "
          f"the gain's CI includes 0 (lower bound ≤ 0) or lies below {B_THRESHOLD} (upper bound < {B_THRESHOLD}). "
          f"Not reproduced if myopic's or myopic-untied's gain has CI lower bound > {B_THRESHOLD}. Otherwise "
          "inconclusive (also with fewer than 2 seeds or myopic missing).")
RULE_C = ("Vanilla runs; per seed, the integrated influence of each component averaged over the tracked sites × "
          "features where the feature is NTP-useless (useful = false); 95% t-CI over seeds. Checked in order: "
          "fewer than 2 seeds → inconclusive; not reproduced if direct has the largest mean of the three components "
          "and is positive; reproduced if mean(pre_cached + shared) > 0, mean(pre_cached + shared) > mean(direct), "
          f"and direct's CI includes 0 or |mean direct| < {C_RATIO} · mean(pre_cached + shared); otherwise "
          "inconclusive.")

# the paper's setting (docs/paper.md#settings), for the settings table
PAPER_SETTINGS = {"seeds": "10 (0–9)", "steps": "3000", "batch_size": "256", "lr": "0.001", "n_layer": "2",
                  "d_model": "128", "n_head": "4", "n_train": "102400", "n_eval": "10240",
                  "sites": "layers 1–2 × positions 2–19"}
PAPER_SITES = {(k, p) for k in (1, 2) for p in range(2, 20)}
SETTING_KEYS = ("steps", "batch_size", "lr", "n_layer", "d_model", "n_head", "n_train", "n_eval")



# ---------------------------------------------------------------------------------------------------- statistics


# ---------------------------------------------------------------------------------------------------- summary


def _ordered(present, order) -> list:
    present = set(present)
    return [x for x in order if x in present] + sorted(present - set(order), key=str)


def _settings(data: dict, n_seeds: int) -> list[dict]:
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    train = data.get("train") or {}
    rows = [{"setting": "scale", "this_run": str(data.get("scale", "?")), "paper": "paper"},
            {"setting": "seeds", "this_run": f"{n_seeds} ({', '.join(str(s) for s in data.get('seeds', []))})",
             "paper": PAPER_SETTINGS["seeds"]}]
    for k in SETTING_KEYS:
        v = train.get(k, defaults.get(k))
        rows.append({"setting": k, "this_run": _plain(v), "paper": PAPER_SETTINGS[k]})
    rows.append({"setting": "sites", "this_run": _sites_text(data.get("sites") or []),
                 "paper": PAPER_SETTINGS["sites"]})
    for k in sorted(set(train) - set(SETTING_KEYS)):
        rows.append({"setting": k, "this_run": _plain(train[k]), "paper": _plain(defaults.get(k, "?"))})
    for r in rows:
        r["differs"] = r["setting"] != "scale" and r["this_run"].split(" (")[0] != r["paper"].split(" (")[0]
    rows[len(SETTING_KEYS) + 2]["differs"] = {tuple(s) for s in data.get("sites") or []} != PAPER_SITES
    return rows


def _spans(positions) -> list[list[int]]:
    """Contiguous runs [a, b] of sorted integer positions."""
    out = []
    for p in sorted(positions):
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return out


def summarize(data: dict) -> dict:
    """Every aggregate of the report and the claims table, from the parsed data.json (pure, no I/O)."""
    runs, probes = data.get("runs") or [], data.get("probes") or []
    influence, curves = data.get("influence") or [], data.get("curves") or []
    records = runs + probes + influence + curves
    tasks = _ordered({r["task"] for r in records}, TASK_ORDER)
    regimes = _ordered({r["regime"] for r in records}, REGIMES)
    seeds = sorted({r["seed"] for r in records} | set(data.get("seeds") or []))
    tracked = data.get("tracked") or {}

    # ---- probes
    r_at = {}
    for p in probes:
        r_at[(p["task"], p["regime"], p["seed"], p["weights"], p["layer"], p["pos"], p["feature"])] = p["r"]
    probe_layers = sorted({p["layer"] for p in probes})

    have = defaultdict(set)
    for p in probes:
        have[p["task"]].add(p["feature"])
    feats_of = {t: [f for f in (PROBE_FEATURES.get(t) or tuple(tracked.get(t, ()))) if f in have[t]] for t in tasks}

    def probe_features(task):
        return feats_of.get(task, [])

    def probe_value(task, regime, seed, weights, layer, pos):
        return _mean(r_at.get((task, regime, seed, weights, layer, pos, f)) for f in probe_features(task))

    profiles, useful_positions = [], {}
    for task in tasks:
        feats = probe_features(task)
        if not feats:
            continue
        useful_positions[task] = sorted({p["pos"] for p in probes if p["task"] == task and p["feature"] in feats
                                         and p["useful"]})
        positions = PROBE_POSITIONS.get(task) or tuple(sorted({p["pos"] for p in probes if p["task"] == task}))
        for weights in ("final", "init"):
            for regime in regimes:
                for layer in probe_layers:
                    for pos in positions:
                        s = stats(probe_value(task, regime, seed, weights, layer, pos) for seed in seeds)
                        if s["n"]:
                            profiles.append({"task": task, "regime": regime, "weights": weights, "layer": layer,
                                             "pos": pos, **s})

    def window(task, regime, seed, weights):
        return _mean(probe_value(task, regime, seed, weights, k, p) for k in CLAIM_LAYERS for p in CLAIM_POSITIONS)

    def gain(task, regime, seed):
        """Mean over (layer, pos) in the claim window of the mean over features of final r − init r."""
        cells = []
        for k in CLAIM_LAYERS:
            for p in CLAIM_POSITIONS:
                diffs = []
                for f in probe_features(task):
                    fin, ini = (r_at.get((task, regime, seed, w, k, p, f)) for w in ("final", "init"))
                    if _finite(fin) and _finite(ini):
                        diffs.append(fin - ini)
                cells.append(_mean(diffs))
        return _mean(cells)

    probe_gain = {}
    for task in tasks:
        feats = probe_features(task)
        if not feats:
            continue
        per_seed = {rg: {s: gain(task, rg, s) for s in seeds} for rg in regimes}
        entry = {"features": feats, "layers": list(CLAIM_LAYERS), "positions": list(CLAIM_POSITIONS),
                 "per_regime": {}, "vs_vanilla": {}, "myopic-untied_vs": {}}
        for rg in regimes:
            entry["per_regime"][rg] = {
                "gain": stats(per_seed[rg].values()),
                "final": stats(window(task, rg, s, "final") for s in seeds),
                "init": stats(window(task, rg, s, "init") for s in seeds),
                "per_seed": [{"seed": s, "gain": g} for s, g in per_seed[rg].items() if g is not None]}

        def paired(a, b, per_seed=per_seed):
            return stats(per_seed[a][s] - per_seed[b][s] for s in seeds
                         if per_seed[a][s] is not None and per_seed[b][s] is not None)

        if "vanilla" in per_seed:
            for rg in regimes:
                if rg != "vanilla":
                    entry["vs_vanilla"][rg] = paired(rg, "vanilla")
        if "myopic-untied" in per_seed:
            for rg in ("myopic", "untied"):
                if rg in per_seed:
                    entry["myopic-untied_vs"][rg] = paired("myopic-untied", rg)
        probe_gain[task] = entry

    # ---- task success
    task_success = {}
    for task in tasks:
        rows = {}
        for rg in regimes:
            sel = [r for r in runs if r["task"] == task and r["regime"] == rg]
            if sel:
                rows[rg] = {m: stats(r.get(m) for r in sel) for m in ("legal_acc", "first_acc", "eval_loss")}
        if rows:
            task_success[task] = rows

    # ---- integrated influence at NTP-useless tracked sites
    useful_map = {(r["task"], r["layer"], r["pos"], r["feature"]): bool(r["useful"]) for r in influence}
    acc = defaultdict(list)
    for r in influence:
        if not r["useful"] and r["component"] in ALL_COMPONENTS:
            acc[(r["task"], r["regime"], r["seed"], r["component"])].append(r["total"])
    n_useless = {}
    for r in influence:
        if not r["useful"]:
            n_useless.setdefault(r["task"], set()).add((r["layer"], r["pos"], r["feature"]))
    infl = {}
    for task in tasks:
        rows = {}
        for rg in regimes:
            per_seed = {c: {s: _mean(acc.get((task, rg, s, c), ())) for s in seeds} for c in ALL_COMPONENTS}
            if not any(v is not None for c in ALL_COMPONENTS for v in per_seed[c].values()):
                continue
            row = {c: stats(per_seed[c].values()) for c in ALL_COMPONENTS}
            row["pre_cached+shared"] = stats(
                per_seed["pre_cached"][s] + per_seed["shared"][s] for s in seeds
                if per_seed["pre_cached"][s] is not None and per_seed["shared"][s] is not None)
            rows[rg] = row
        if rows:
            infl[task] = {"n_site_features": len(n_useless.get(task, ())),
                          "site_features": sorted([list(x) for x in n_useless.get(task, ())]),
                          "per_regime": rows}

    # ---- influence curves at NTP-useless tracked sites
    cacc = defaultdict(list)
    for r in curves:
        key = (r["task"], r["layer"], r["pos"], r["feature"])
        useful = useful_map.get(key, r["pos"] >= 10)
        if not useful and r["component"] in ALL_COMPONENTS:
            cacc[(r["task"], r["regime"], r["component"], r["step"], r["seed"])].append(r["cumulative"])
    by_curve = defaultdict(lambda: defaultdict(list))
    for (task, rg, c, step, seed), vals in cacc.items():
        by_curve[(task, rg, c)][step].append(_mean(vals))
    curve_rows = []
    for task in tasks:
        for rg in regimes:
            for c in ALL_COMPONENTS:
                for step in sorted(by_curve.get((task, rg, c), {})):
                    s = stats(by_curve[(task, rg, c)][step])
                    if s["n"]:
                        curve_rows.append({"task": task, "regime": rg, "component": c, "step": step, **s})

    summary = {
        "scale": data.get("scale"), "seeds": seeds, "n_seeds": len(seeds), "sites": data.get("sites") or [],
        "train": data.get("train") or {}, "tracked": tracked, "tasks": tasks, "regimes": regimes,
        "settings": _settings(data, len(seeds)), "sign_convention": SIGN, "influence_unit": INFLUENCE_UNIT,
        "ci": "two-sided 95% Student-t interval over seeds; lo/hi are null when n < 2",
        "probe_layers": probe_layers, "probe_positions": {t: list(PROBE_POSITIONS.get(t, ())) for t in tasks},
        "useful_positions": useful_positions, "probe_profiles": profiles, "probe_gain": probe_gain,
        "task_success": task_success, "influence": infl, "influence_curves": curve_rows,
    }
    summary["claims"] = _claims(summary)
    return summary


# ---------------------------------------------------------------------------------------------------- claims


def _claim_a(summary) -> dict:
    row = {"claim": CLAIM_A, "task": "majority", "rule": RULE_A}
    pg = summary["probe_gain"].get("majority")
    need = ("vanilla", "myopic", "untied", "myopic-untied")
    if pg is None or any(r not in pg["per_regime"] for r in need):
        return {**row, "measured": "no data for every regime of the majority task", "verdict": "inconclusive"}
    g = {r: pg["per_regime"][r]["gain"] for r in need}
    d = pg["vs_vanilla"]
    mu = pg["myopic-untied_vs"]
    n = min(s["n"] for s in g.values())
    measured = ("gain of probe r over init (layers 1–2, pos 2–9): "
                + "; ".join(f"{r} {_ci(g[r])}" for r in need)
                + ". Paired Δ vs vanilla: " + "; ".join(f"{r} {_ci(d.get(r))}" for r in need[1:])
                + f". n = {n} seeds")
    if n < 2 or any(not _has_ci(d.get(r)) for r in need[1:]):
        return {**row, "measured": measured, "verdict": "inconclusive"}
    means = {r: g[r]["mean"] for r in need}
    against = any(d[r]["lo"] > 0 for r in need[1:]) or any(_has_ci(mu.get(r)) and mu[r]["lo"] > 0
                                                              for r in ("myopic", "untied"))
    lowest = all(means["myopic-untied"] < means[r] for r in need[:3])
    if against:
        verdict = "not reproduced"
    elif d["myopic"]["hi"] < 0 and d["untied"]["hi"] < 0 and lowest:
        verdict = "reproduced"
    else:
        verdict = "inconclusive"
    return {**row, "measured": measured, "verdict": verdict}


def _claim_b(summary) -> dict:
    row = {"claim": CLAIM_B, "task": "cond_majority", "rule": RULE_B}
    pg = summary["probe_gain"].get("cond_majority")
    if pg is None or "vanilla" not in pg["per_regime"] or "myopic" not in pg["per_regime"]:
        return {**row, "measured": "no data for vanilla and myopic on the cond_majority task",
                "verdict": "inconclusive"}
    myopic = [r for r in ("myopic", "myopic-untied") if r in pg["per_regime"]]
    g = {r: pg["per_regime"][r]["gain"] for r in ["vanilla", *myopic]}
    n = min(s["n"] for s in g.values())
    measured = ("gain of prev_is_<0> probe r over init (layers 1–2, pos 2–9): "
                + "; ".join(f"{r} {_ci(s)}" for r, s in g.items()) + f". n = {n} seeds")
    if n < 2 or not all(_has_ci(s) for s in g.values()):
        return {**row, "measured": measured, "verdict": "inconclusive"}
    if any(g[r]["lo"] > B_THRESHOLD for r in myopic):
        verdict = "not reproduced"
    elif g["vanilla"]["lo"] > 0 and all(g[r]["lo"] <= 0 or g[r]["hi"] < B_THRESHOLD for r in myopic):
        verdict = "reproduced"
    else:
        verdict = "inconclusive"
    return {**row, "measured": measured, "verdict": verdict}


def _claim_c(summary, task) -> dict:
    row = {"claim": CLAIM_C, "task": task, "rule": RULE_C}
    entry = summary["influence"].get(task)
    v = entry["per_regime"].get("vanilla") if entry else None
    if v is None or any(v[c]["mean"] is None for c in COMPONENTS):
        return {**row, "measured": f"no vanilla influence at NTP-useless sites for {task}",
                "verdict": "inconclusive"}
    ps = v["pre_cached+shared"]
    n = min(v[c]["n"] for c in COMPONENTS)
    measured = ("integrated influence, vanilla, NTP-useless sites (+ = toward final value): "
                + "; ".join(f"{c} {_ci(v[c], _g)}" for c in COMPONENTS)
                + f"; pre_cached+shared {_ci(ps, _g)}. n = {n} seeds")
    if n < 2 or not _has_ci(v["direct"]) or ps["mean"] is None:
        return {**row, "measured": measured, "verdict": "inconclusive"}
    m = {c: v[c]["mean"] for c in COMPONENTS}
    direct, indirect = m["direct"], ps["mean"]
    direct_small = (v["direct"]["lo"] <= 0 <= v["direct"]["hi"]) or abs(direct) < C_RATIO * indirect
    if direct > 0 and direct > m["pre_cached"] and direct > m["shared"]:
        verdict = "not reproduced"
    elif indirect > 0 and indirect > direct and direct_small:
        verdict = "reproduced"
    else:
        verdict = "inconclusive"
    return {**row, "measured": measured, "verdict": verdict}


def _claims(summary) -> list[dict]:
    tasks_c = [t for t in summary["tasks"] if t in summary["influence"]] or ["majority", "cond_majority"]
    return [_claim_a(summary), _claim_b(summary), *(_claim_c(summary, t) for t in tasks_c)]


# ---------------------------------------------------------------------------------------------------- figures


def _color(kind: str, key: str, order) -> str:
    table = REGIME_COLORS if kind == "regime" else COMPONENT_COLORS
    if key in table:
        return table[key]
    extra = [k for k in order if k not in table]
    return EXTRA_COLORS[extra.index(key) % len(EXTRA_COLORS)] if key in extra else "#000000"


def _fig_probe(summary, task, figdir) -> bytes | None:
    import matplotlib

    rows = [r for r in summary["probe_profiles"] if r["task"] == task]
    if not rows:
        return None
    layers = sorted({r["layer"] for r in rows})
    regimes = [rg for rg in summary["regimes"] if any(r["regime"] == rg and r["weights"] == "final" for r in rows)]
    base_rg = "vanilla" if "vanilla" in regimes else (regimes[0] if regimes else None)
    n = summary["n_seeds"]
    with matplotlib.rc_context(_RC):
        fig, axes = _grid(4.3 * len(layers), 4.2, 1, len(layers), left=0.75, right=0.15, top=0.62, bottom=0.95,
                          wspace=0.2, sharey=True)
        axes = axes[0]
        for ax, layer in zip(axes, layers):
            for i, (a, b) in enumerate(_spans(summary["useful_positions"].get(task, []))):
                ax.axvspan(a - 0.5, b + 0.5, color="#000000", alpha=0.07, lw=0,
                           label="NTP-useful positions (pos ≥ 10)" if i == 0 else None)
            ax.axhline(0, color="#000000", lw=0.6)
            base = sorted((r for r in rows if r["regime"] == base_rg and r["weights"] == "init"
                           and r["layer"] == layer), key=lambda r: r["pos"])
            if base:
                ax.plot([r["pos"] for r in base], [r["mean"] for r in base], ls="--", color=BASELINE_COLOR, lw=1.5,
                        zorder=4,
                        label=f"untrained baseline ({base_rg}, init weights)")
            for rg in regimes:
                sel = sorted((r for r in rows if r["regime"] == rg and r["weights"] == "final" and r["layer"] == layer),
                             key=lambda r: r["pos"])
                if not sel:
                    continue
                xs = [r["pos"] for r in sel]
                color = _color("regime", rg, summary["regimes"])
                _band(ax, xs, sel, color)
                ax.plot(xs, [r["mean"] for r in sel], marker="o", ms=3, lw=1.6, color=color, label=rg)
            ax.set_title(f"resid[{layer}]" + (" (embeddings)" if layer == 0 else f" (output of blocks.{layer - 1})"))
            ax.set_xlabel("position t (token index; inputs 1–10)")
            positions = summary["probe_positions"].get(task) or [r["pos"] for r in rows]
            ax.set_xlim(min(positions) - 0.6, max(positions) + 0.6)
            ax.set_xticks([p for p in positions if p % 2 == 1 or p == min(positions)])
        axes[0].set_ylabel("probe Pearson r on held-out data (unitless)")
        ci = f"mean and 95% t-CI over {n} seeds" if n >= 2 else "mean of 1 seed (no CI)"
        handles, labels = axes[0].get_legend_handles_labels()
        _finish(fig, f"{TASK_TITLES.get(task, task)}: probe quality of {FEATURE_TITLES.get(task, task)}; {ci}",
                handles, labels, min(len(labels), 6))
        return _save(fig, figdir, f"probe_{task}")


def _bar_group(ax, centers, items, width):
    """items: list of (label, color, [stats per center]) drawn as adjacent bars around each center, with CI whiskers."""
    k = len(items)
    for j, (label, color, per_center) in enumerate(items):
        pts = [(x + (j - (k - 1) / 2) * width, s) for x, s in zip(centers, per_center)
               if s is not None and s["mean"] is not None]
        if not pts:
            continue
        ax.bar([x for x, _ in pts], [s["mean"] for _, s in pts], width=width * 0.92, color=color, label=label,
               edgecolor="white", lw=0.5)
        ci = [(x, s) for x, s in pts if _has_ci(s)]
        if ci:
            ax.errorbar([x for x, _ in ci], [s["mean"] for _, s in ci],
                        yerr=[[s["mean"] - s["lo"] for _, s in ci], [s["hi"] - s["mean"] for _, s in ci]],
                        fmt="none", ecolor="#000000", capsize=2.5, elinewidth=1)


def _dedupe_legend(ax):
    handles, labels = ax.get_legend_handles_labels()
    seen, hs, ls = set(), [], []
    for h, lab in zip(handles, labels):
        if lab not in seen:
            seen.add(lab)
            hs.append(h)
            ls.append(lab)
    return hs, ls


def _fig_task_success(summary, figdir) -> bytes | None:
    import matplotlib

    ts = summary["task_success"]
    if not ts:
        return None
    metrics = (("legal_acc", "legal-output accuracy"), ("first_acc", "first-output accuracy"))
    n = summary["n_seeds"]
    with matplotlib.rc_context(_RC):
        fig, axes = _grid(5.2 * len(ts), 4.2, 1, len(ts), left=0.75, right=0.15, top=0.62, bottom=0.72, wspace=0.2,
                          sharey=True)
        axes = axes[0]
        hs, ls = [], []
        for ax, (task, rows) in zip(axes, ts.items()):
            regimes = [rg for rg in summary["regimes"] if rg in rows]
            items = [(rg, _color("regime", rg, summary["regimes"]), [rows[rg][m] for m, _ in metrics])
                     for rg in regimes]
            _bar_group(ax, range(len(metrics)), items, 0.8 / max(1, len(regimes)))
            for j, rg in enumerate(regimes):
                for i, (m, _) in enumerate(metrics):
                    s = rows[rg][m]
                    if s["mean"] is not None:  # the value, inside tall bars and above short ones
                        x = i + (j - (len(regimes) - 1) / 2) * 0.8 / len(regimes)
                        inside = s["mean"] >= 0.25
                        ax.text(x, 0.02 if inside else s["mean"] + 0.02, f"{s['mean']:.2f}", rotation=90,
                                ha="center", va="bottom", fontsize=8, color="white" if inside else "#000000")
            ax.set_xticks(range(len(metrics)), [lab for _, lab in metrics])
            ax.set_ylim(0, 1.05)
            ax.set_title(TASK_TITLES.get(task, task))
            ax.grid(axis="x", visible=False)
            h, lab = _dedupe_legend(ax)
            for hh, ll in zip(h, lab):
                if ll not in ls:
                    hs.append(hh)
                    ls.append(ll)
        axes[0].set_ylabel("accuracy (fraction of eval predictions)")
        ci = f"bars: mean; whiskers: 95% t-CI over {n} seeds" if n >= 2 else "bars: 1 seed (no CI)"
        _finish(fig, f"Task success per regime ({ci})", hs, ls, len(ls))
        return _save(fig, figdir, "task_success")


def _fig_influence_curves(summary, figdir) -> bytes | None:
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    rows = summary["influence_curves"]
    if not rows:
        return None
    tasks = [t for t in summary["tasks"] if any(r["task"] == t for r in rows)]
    regimes = [rg for rg in summary["regimes"] if any(r["regime"] == rg for r in rows)]
    n = summary["n_seeds"]
    with matplotlib.rc_context(_RC):
        fig, axes = _grid(3.4 * len(regimes) + 0.8, 2.9 * len(tasks) + 1.55, len(tasks), len(regimes), left=1.0,
                          right=0.15, top=0.95, bottom=0.85, wspace=0.2, hspace=0.45, sharex=True)
        for i, task in enumerate(tasks):
            for j, rg in enumerate(regimes):
                ax = axes[i][j]
                if j > 0:  # one y scale per task (row)
                    ax.sharey(axes[i][0])
                    ax.tick_params(labelleft=False)
                ax.axhline(0, color="#000000", lw=0.6)
                for c in ALL_COMPONENTS:
                    sel = sorted((r for r in rows if r["task"] == task and r["regime"] == rg and r["component"] == c),
                                 key=lambda r: r["step"])
                    if not sel:
                        continue
                    xs = [r["step"] for r in sel]
                    color = _color("component", c, ALL_COMPONENTS)
                    if c != "full":
                        _band(ax, xs, sel, color)
                    ax.plot(xs, [r["mean"] for r in sel], color=color, lw=1.2 if c == "full" else 1.8,
                            ls="--" if c == "full" else "-", label=COMPONENT_LABELS[c])
                ax.set_title(f"{TASK_TITLES.get(task, task)} · {rg}")
                if i == len(tasks) - 1:
                    ax.set_xlabel("training step")
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                if j == 0:
                    ax.set_ylabel("cumulative influence (probe units²)\n+ = toward final value")
        ci = f"mean and 95% t-CI over {n} seeds" if n >= 2 else "1 seed (no CI)"
        hs, ls = _dedupe_legend(axes[0][0])
        _finish(fig, "Cumulative Adam influence at NTP-useless tracked sites (mean over sites × features; "
                f"{ci}).\n{SIGN}", hs, ls, len(ls))
        return _save(fig, figdir, "influence_curves")


def _fig_influence_bars(summary, figdir) -> bytes | None:
    import matplotlib

    infl = summary["influence"]
    if not infl:
        return None
    n = summary["n_seeds"]
    with matplotlib.rc_context(_RC):
        panel = max(5.0, 1.3 * len(summary["regimes"]) + 0.6)
        fig, axes = _grid(panel * len(infl) + 1.0 * len(infl), 4.6, 1, len(infl), left=1.0, right=0.15, top=0.95,
                          bottom=1.0, wspace=1.0)
        axes = axes[0]
        for ax, (task, entry) in zip(axes, infl.items()):
            rows = entry["per_regime"]
            regimes = [rg for rg in summary["regimes"] if rg in rows]
            items = [(COMPONENT_LABELS[c], _color("component", c, ALL_COMPONENTS), [rows[rg][c] for rg in regimes])
                     for c in ALL_COMPONENTS]
            ax.axhline(0, color="#000000", lw=0.6)
            _bar_group(ax, range(len(regimes)), items, 0.8 / len(items))
            ax.set_xticks(range(len(regimes)), regimes)
            ax.set_xlabel("training regime")
            ax.set_title(f"{TASK_TITLES.get(task, task)} "
                         f"({entry['n_site_features']} NTP-useless site × feature pair(s))")
            ax.grid(axis="x", visible=False)
            ax.set_ylabel("integrated influence (probe units²)\n+ = toward final value")
        ci = f"mean and 95% t-CI over {n} seeds" if n >= 2 else "1 seed (no CI)"
        hs, ls = _dedupe_legend(axes[0])
        _finish(fig, f"Integrated Adam influence at NTP-useless tracked sites ({ci}).\n{SIGN}", hs, ls, len(ls))
        return _save(fig, figdir, "influence_bars")


def make_figures(summary: dict, figdir: Path) -> dict[str, bytes]:
    """Draw every figure that has data; returns {name: PNG bytes}."""
    figdir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, fn in (("probe_majority", lambda: _fig_probe(summary, "majority", figdir)),
                     ("probe_cond_majority", lambda: _fig_probe(summary, "cond_majority", figdir)),
                     ("task_success", lambda: _fig_task_success(summary, figdir)),
                     ("influence_curves", lambda: _fig_influence_curves(summary, figdir)),
                     ("influence_bars", lambda: _fig_influence_bars(summary, figdir))):
        png = fn()
        if png is not None:
            out[name] = png
    return out


# ---------------------------------------------------------------------------------------------------- document


def _document(summary: dict, figures) -> list[tuple]:
    """The report as blocks: ("h1"|"h2"|"p", text), ("table", header, rows, id), ("fig", name, caption)."""
    n = summary["n_seeds"]
    if n >= 2:
        ci_note = "Intervals: two-sided 95% Student-t intervals over seeds (the seed is the unit of replication)."
    elif n == 1:
        ci_note = "Only 1 seed: means only, no intervals; every verdict that needs a CI is inconclusive."
    else:
        ci_note = "No runs in data.json: nothing to report; every verdict is inconclusive."
    b = [("h1", "Toy tasks: majority and conditioned majority (docs/paper.md#majority, claims 1–2)"),
         ("p", (f"Scale {summary['scale']!s}, {n} seed(s), tasks: {', '.join(summary['tasks']) or 'none'}, "
                f"regimes: {', '.join(summary['regimes']) or 'none'}. {ci_note} {SIGN} Influence unit: "
                f"{INFLUENCE_UNIT}. Every number below is also in summary.json."))]

    b.append(("h2", "Scale and settings"))
    b.append(("p", ("This run against the paper's setting (values not overridden in data.json's train are "
                    "TrainConfig defaults). Rows marked 'yes' differ from the paper, so absolute numbers are not "
                    "comparable with it; the claims are qualitative.")))
    b.append(("table", ["setting", "this run", "paper", "differs"],
              [[s["setting"], s["this_run"], s["paper"], "yes" if s["differs"] else ""] for s in summary["settings"]],
              None))

    b.append(("h2", "Claims"))
    b.append(("table", ["claim", "task", "measured", "verdict", "rule"],
              [[f"“{c['claim']}”", c["task"], c["measured"], c["verdict"], c["rule"]] for c in summary["claims"]],
              "claims"))
    b.append(("p", ("Decision rules (fixed before looking at the numbers; verdicts are whatever the numbers "
                    f"give): (a) {RULE_A} (b) {RULE_B} (c) {RULE_C}")))

    def fig(name, caption):
        if name in figures:
            b.append(("fig", name, caption))
        else:
            b.append(("p", f"Figure {name}: not drawn (no data for it in data.json)."))

    shade = "Grey shading: positions where the feature is NTP-useful (pos ≥ 10)."
    ci_fig = "Lines: mean over seeds; bands: 95% t-CI over seeds." if n >= 2 else "Lines: the single seed."
    pg = summary["probe_gain"]
    for task, title, feat in (("majority", "Probe quality: majority", "is_majority_<v>, mean over v"),
                              ("cond_majority", "Probe quality: conditioned majority", "prev_is_<0>")):
        b.append(("h2", title))
        fig(f"probe_{task}",
            f"Test Pearson r of linear probes for {feat} at each position, one panel per residual layer, "
            f"final weights per regime; dashed grey: the untrained model (init weights, vanilla). {ci_fig} {shade}")
        if task in pg:
            e = pg[task]
            b.append(("p", (f"Probe gain = final r − init r of the same seed, averaged over layers "
                            f"{e['layers'][0]}–{e['layers'][-1]} and input positions {e['positions'][0]}–"
                            f"{e['positions'][-1]} (NTP-useless); Δ vs vanilla is paired by seed.")))
            rows = []
            for rg, v in e["per_regime"].items():
                rows.append([rg, _ci(v["final"]), _ci(v["init"]), _ci(v["gain"]),
                             _ci(e["vs_vanilla"].get(rg)) if rg != "vanilla" else "—", str(v["gain"]["n"])])
            b.append(("table", ["regime", "final r", "init r", "gain", "Δ gain vs vanilla", "n"], rows, None))
            mu = e["myopic-untied_vs"]
            if mu:
                b.append(("p", "Paired Δ gain, myopic-untied minus: "
                          + "; ".join(f"{rg} {_ci(s)}" for rg, s in mu.items()) + "."))
        else:
            b.append(("p", f"No probe data for {task}."))

    b.append(("h2", "Task success"))
    fig("task_success", "Legal-output accuracy: share of output-position argmax predictions inside the legal "
                        "(majority) "
                        "set; first-output accuracy: the same for the first output only, which needs the counts over "
                        "the inputs. " + ("Whiskers: 95% t-CI over seeds." if n >= 2 else "Single seed."))
    rows = []
    for task, per in summary["task_success"].items():
        for rg, v in per.items():
            rows.append([task, rg, _ci(v["legal_acc"]), _ci(v["first_acc"]), _ci(v["eval_loss"]),
                         str(v["legal_acc"]["n"])])
    if rows:
        b.append(("table", ["task", "regime", "legal-output acc.", "first-output acc.", "eval loss (nats/token)",
                            "n"], rows, None))

    b.append(("h2", "Influence over training"))
    fig("influence_curves", "Cumulative Adam influence of each gradient component (direct, pre-cached, shared; "
                            "dashed: full = their sum) on the tracked feature, averaged over the tracked sites × "
                            f"features where the feature is NTP-useless. {ci_fig} {SIGN}")

    b.append(("h2", "Integrated influence"))
    fig("influence_bars", "Integrated (whole-training) Adam influence per component and regime: mean over seeds of "
                          "the mean over NTP-useless tracked sites × features. "
                          + ("Whiskers: 95% t-CI over seeds. " if n >= 2 else "Single seed. ") + SIGN)
    rows = []
    for task, entry in summary["influence"].items():
        for rg, v in entry["per_regime"].items():
            rows.append([task, rg, *(_ci(v[c], _g) for c in ALL_COMPONENTS), _ci(v["pre_cached+shared"], _g),
                         str(v["direct"]["n"])])
    if rows:
        b.append(("p", f"Integrated influence in {INFLUENCE_UNIT}. {SIGN}"))
        b.append(("table", ["task", "regime", "direct", "pre-cached", "shared", "full", "pre-cached + shared", "n"],
                  rows, None))
    else:
        b.append(("p", "No influence data."))
    return b


# ---------------------------------------------------------------------------------------------------- entry point


def write_report(out_dir: str | Path) -> Path:
    """Read ``out_dir/data.json``; write figures/, summary.json, report.md and report.html. Returns report.md's path."""
    return write_from_data(out_dir, summarize, make_figures, _document)


def main(argv=None) -> None:
    """Command line: write the report of the folder OUT holding data.json and print the report.md path."""
    report_main("toy_report", "toy-task", write_report, argv)


if __name__ == "__main__":
    main()
