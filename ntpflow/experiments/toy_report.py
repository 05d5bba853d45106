"""Report of the toy-task reproduction (docs/paper.md#toy-tasks) from ``OUT/data.json``.

``write_report(out_dir)`` reads ``out_dir/data.json`` (written by ``ntpflow.experiments.toy.run_toy``; schema in
docs/outputs.md) and writes ``figures/*.{png,svg}``, ``summary.json`` (every number shown, and the claims),
``report.md`` and ``report.html``.

What makes a verdict here:

- **Gates.** A claim about what training does to a feature is only testable on models that learned their task. Each
  claim lists its preconditions (e.g. vanilla reaches first-output accuracy >= 0.99 and an eval loss within 0.01
  of the task's exact optimum on every seed); if one fails the verdict is "not testable at this scale".
- **Two mismatches.** The influence claim is decided on the centred mismatch R_c (the batch variance of the probe
  projection's difference from the final model), which measures whether the feature varies like the final one;
  the paper's R = R_c + (mean difference)² is shown beside it, with the offset share of R at step 0 and the
  balance of each (integrated influence against the mismatch actually removed on held-out data).

Statistics: the seed is the unit of replication; intervals are two-sided 95% Student-t intervals over seeds, for a
Pearson r computed in Fisher z and transformed back (so they stay inside [−1, 1]); accuracy intervals are clipped
to [0, 1] (said in the captions). Positions: logits at p predict token p+1; resid[k] is the output of block k−1.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ntpflow.experiments import figure_style as fs
from ntpflow.experiments.claim_registry import (
    B_MARGIN,
    CLAIM_LAYERS,
    CLAIM_POSITIONS,
    GATE_ACC,
    GATE_GAP,
    account_text,
    toy_claims,
    toy_influence_checks,
)
from ntpflow.experiments.formats import (
    COMPONENT_LABELS,
    COMPONENTS,
    plain_number,
    read_at_settings,
    select,
    sites_text,
    train_settings,
)
from ntpflow.experiments.render import report_main, template_blocks, write_from_data
from ntpflow.model.sites import feature_name
from ntpflow.replay.summary import residual_share
from ntpflow.runs.config import REGIMES
from ntpflow.stats import mean_of, paired, r_stats, stat_rows, stats

TASK_ORDER = ("majority", "cond_majority")
TASK_TITLES = {"majority": "majority", "cond_majority": "conditioned majority"}
MISMATCHES = ("centred", "paper")
MISMATCH_LABELS = {"centred": "R_c = var(d), centred", "paper": "R = mean(d²), paper"}
REGIME_COLORS = fs.REGIME_COLORS
PROBE_FEATURES = {"majority": ("is_majority_0", "is_majority_1", "is_majority_2"),
                  "cond_majority": ("prev_is_0",)}
PAPER_SETTINGS = {"seeds": "10", "steps": "3000", "batch_size": "256", "lr": "0.001", "n_layer": "2",
                  "d_model": "128", "n_head": "4", "n_train": "102400", "n_eval": "10240"}
INFLUENCE_UNIT = "probe units² (the decrease of the mismatch R that the component caused)"


def summarize(data: dict) -> dict:
    """Every aggregate of the report and the claims, from the parsed data.json (pure, no I/O)."""
    runs, probes = data.get("runs") or [], data.get("probes") or []
    influence, mismatch = data.get("influence") or [], data.get("mismatch") or []
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in runs + probes)]
    regimes = [g for g in REGIMES if any(r["regime"] == g for r in runs + probes)]
    seeds = sorted({r["seed"] for r in runs + probes})
    n_layer = max([p["layer"] for p in probes], default=2)
    success, gates = _task_success(runs, tasks, regimes)
    layers = sorted({p["layer"] for p in probes})
    profiles = _probe_profiles(probes, tasks, regimes, seeds, layers)
    probe_gain = _probe_gain(probes, tasks, regimes, seeds)
    own = data.get("optimizer", "adam")  # the runs' own split; results before the option: Adam's
    offset_rows, balance_rows, site_rows = _balance([r for r in influence if r.get("optimizer", own) == own], mismatch)
    summary = {"scale": data.get("scale"), "seeds": seeds, "n_seeds": len(seeds), "tasks": tasks,
               "regimes": regimes, "sites": data.get("sites") or [], "n_layer": n_layer,
               "tracked_seeds": data.get("tracked_seeds", seeds), "train": data.get("train") or {},
               "task_train": data.get("task_train") or {}, "settings": _settings(data, len(seeds)),
               "sign_convention": fs.SIGN, "influence_unit": INFLUENCE_UNIT,
               "ci": "two-sided 95% Student-t interval over seeds (Pearson r: in Fisher z); null when n < 2",
               "task_success": success, "gates": gates, "learning": _learning(data.get("eval_curves") or [], tasks, seeds),
               "probe_layers": layers, "probe_profiles": profiles,
               "optimizer": own, "probe_gain": probe_gain, "influence": _influence(influence, tasks, n_layer, own),
               "offset_share": offset_rows, "conditioning": _conditioning(mismatch, tasks, n_layer),
               "balance": balance_rows, "sites_detail": site_rows,
               "influence_curves": _influence_curves(data.get("curves") or [], n_layer),
               "exact_account": {t: residual_share(r for r in mismatch if r["task"] == t and r["mismatch"] == "centred"
                                                   and _useless(r, n_layer)) for t in tasks}}
    summary["claims"] = [c.to_dict() for c in toy_claims(summary)]
    return summary


def _task_success(runs: list[dict], tasks: list[str], regimes: list[str]) -> tuple[dict, dict]:
    """``(success, gates)``: per task × regime the stats over seeds of the final scores, and per task what the
    vanilla seeds reached (the preconditions of the claims)."""
    success, gates = {}, {}
    for t in tasks:
        success[t] = {}
        for g in regimes:
            sel = select(runs, "seed", task=t, regime=g)
            if sel:
                success[t][g] = {m: stats(r.get(m) for r in sel) for m in ("eval_loss", "loss_gap")}
                for m in ("first_acc", "legal_acc"):  # a proportion: its interval clipped to [0, 1]
                    st = stats(r.get(m) for r in sel)
                    success[t][g][m] = {**st, **dict(zip(("lo", "hi"), fs.clip(st["lo"], st["hi"], (0.0, 1.0))))}
                success[t][g]["per_seed"] = [{k: r.get(k) for k in ("seed", "eval_loss", "loss_gap", "first_acc",
                                                                    "steps")} for r in sel]
        van = [r for r in runs if (r["task"], r["regime"]) == (t, "vanilla")]
        gates[t] = {"n": len(van), "min_first_acc": min((r["first_acc"] for r in van), default=None),
                    "max_loss_gap": max((r["loss_gap"] for r in van if r.get("loss_gap") is not None), default=None),
                    "optimal_loss": next((r.get("optimal_loss") for r in van), None),
                    "steps": next((r.get("steps") for r in van), None)}
    return success, gates


def _learning(eval_curves: list[dict], tasks: list[str], seeds: list[int]) -> dict:
    """Per task: from which evaluation on each vanilla seed passes both gates, and the vanilla learning curves."""
    learning = {}
    for t in tasks:
        per_seed, van_curves = {}, []
        for sd in seeds:
            ev = select(eval_curves, "step", task=t, regime="vanilla", seed=sd)
            van_curves += [{k: e[k] for k in ("seed", "step", "loss_gap", "first_acc")} for e in ev]
            if ev:
                ok = [e["first_acc"] is not None and e["first_acc"] >= GATE_ACC and e["loss_gap"] <= GATE_GAP
                      for e in ev]
                tail = next((i for i in range(len(ok)) if all(ok[i:])), None)  # passes at every evaluation after
                per_seed[sd] = None if tail is None else ev[tail]["step"]
        if per_seed:
            learning[t] = {"pass_from": [{"seed": sd, "step": st} for sd, st in per_seed.items()],
                           "last_step": max(e["step"] for e in van_curves),
                           "all_pass_from": None if None in per_seed.values() else max(per_seed.values()),
                           "curves": van_curves}
    return learning


def _probe_r(probes: list[dict]):
    """``r_of(task, regime, seed, weights, layer, pos)``: the probe r there, mean over the task's probed features."""
    r_at = {(p["task"], p["regime"], p["seed"], p["weights"], p["layer"], p["pos"], feature_name(p["feature"])): p["r"]
            for p in probes}  # data.json of results written before 0.2 spells is_majority_<0>
    return lambda t, g, s, w, k, i: mean_of(r_at.get((t, g, s, w, k, i, f)) for f in PROBE_FEATURES[t])


def _probe_profiles(probes: list[dict], tasks, regimes, seeds, layers) -> list[dict]:
    """Rows of the probe figures: per task × regime (step 0: vanilla) × layer × position, r over seeds."""
    r_of = _probe_r(probes)
    profiles = []
    for t in tasks:
        positions = sorted({p["pos"] for p in probes if p["task"] == t and p["pos"] >= 1})
        for w in ("final", "init"):
            for g in regimes if w == "final" else ["vanilla"]:
                for k in layers:
                    for i in positions:
                        s = r_stats(r_of(t, g, sd, w, k, i) for sd in seeds)
                        if s["n"]:
                            profiles.append({"task": t, "regime": g, "weights": w, "layer": k, "pos": i, **s})
    return profiles


def _probe_gain(probes: list[dict], tasks, regimes, seeds) -> dict:
    """Per task: the probe r in the claims' window (final, step 0, their gain) per regime, and the paired
    differences of the gains between regimes."""
    r_of = _probe_r(probes)

    def window(t, g, s, w):
        return mean_of(r_of(t, g, s, w, k, i) for k in CLAIM_LAYERS for i in CLAIM_POSITIONS)

    probe_gain = {}
    for t in tasks:
        per = {g: {s: (window(t, g, s, "final"), window(t, g, s, "init")) for s in seeds} for g in regimes}
        gain = {g: {s: (f - i if f is not None and i is not None else None) for s, (f, i) in per[g].items()}
                for g in regimes}

        probe_gain[t] = {
            "per_regime": {g: {"final": r_stats(f for f, _ in per[g].values()),
                               "init": r_stats(i for _, i in per[g].values()),
                               "gain": stats(gain[g].values()), "gain_per_seed": list(gain[g].values()),
                               "min_final": min((f for f, _ in per[g].values() if f is not None), default=None)}
                           for g in regimes},
            "vs_vanilla": {g: paired(gain[g], gain["vanilla"]) for g in regimes
                           if g != "vanilla" and "vanilla" in gain},
            "myopic-untied_vs": {g: paired(gain["myopic-untied"], gain[g]) for g in ("myopic", "untied")
                                 if g in gain and "myopic-untied" in gain}}
    return probe_gain


def _useless(r: dict, n_layer: int) -> bool:
    """An NTP-useless site below the last layer (pre-caching is zero by construction at the last)."""
    return not r["useful"] and r["layer"] < n_layer


def _influence(influence: list[dict], tasks, n_layer: int, own: str = "adam") -> dict:
    """Per task × mismatch: each component's integrated influence at the useless sites in the run's own reading
    ``own``, stats over seeds (``per_seed`` in seed order), and under ``"sgd"`` the same of the SGD direction where
    the replays kept it."""
    acc = defaultdict(list)
    for r in influence:
        if _useless(r, n_layer):
            reading = r.get("optimizer", own)  # records before the SGD direction was kept: the own reading
            acc[(r["task"], r["mismatch"], r["seed"], r["component"], reading)].append(r["total"])
    infl = {}
    for t in tasks:
        for m in MISMATCHES:
            tracked_seeds = sorted({s for (tt, mm, s, _, o) in acc if (tt, mm, o) == (t, m, own)})
            if not tracked_seeds:
                continue
            rows = {}
            for reading in (own, "sgd"):
                per = {c: {s: mean_of(acc.get((t, m, s, c, reading), ())) for s in tracked_seeds}
                       for c in (*COMPONENTS, "full")}
                if reading != own and any(v is None for p in per.values() for v in p.values()):
                    continue  # no SGD direction kept for every seed
                rows[reading] = {c: {**stats(per[c].values()), "per_seed": list(per[c].values())} for c in per}
            row = rows[own]
            row["pre_cached+shared"] = stats(row["pre_cached"]["per_seed"][j] + row["shared"]["per_seed"][j]
                                             for j in range(len(tracked_seeds)))
            if "sgd" in rows and own != "sgd":
                row["sgd"] = rows["sgd"]
            row["seeds"] = tracked_seeds
            infl.setdefault(t, {})[m] = row
    return infl


def _conditioning(mismatch: list[dict], tasks, n_layer: int) -> dict:
    """Per task × mismatch, over the replays' rows (seed × useless site below the last layer × feature): κ of each
    reading from its totals and from its steps (median and largest), and how many components the run's own reading
    and the SGD direction give the same sign (docs/balance.md#conditioning). Empty for rows written before κ."""
    out: dict = {}
    for t in tasks:
        for m in MISMATCHES:
            rows = [r for r in mismatch if r["task"] == t and r["mismatch"] == m and _useless(r, n_layer)]
            entry = {}
            for key in sorted({k for r in rows for k in r if k.startswith("kappa")}):
                values = sorted(r[key] for r in rows if r.get(key) is not None)
                if values:
                    entry[key] = {"median": values[len(values) // 2], "largest": values[-1], "n": len(values)}
            agree = [v for r in rows for v in (r.get("signs_agree") or {}).values()]
            if agree:
                entry["signs_agree"] = {"agree": sum(agree), "n": len(agree)}
            if entry:
                out.setdefault(t, {})[m] = entry
    return out


def _balance(influence: list[dict], mismatch: list[dict]) -> tuple[list, list, list]:
    """``(offset_rows, balance_rows, site_rows)``: the offset share of R(θ_0) per task × where × position, the
    balance check per task × mismatch × useless/useful sites, and per site × feature (vanilla, mean over tracked
    seeds) the offset share, both decompositions and their balance."""
    balance = defaultdict(list)
    full_total = {(r["task"], r["seed"], r["layer"], r["pos"], r["feature"], r["mismatch"]): r["total"]
                  for r in influence if r["component"] == "full"}
    for r in mismatch:
        f = full_total.get((r["task"], r["seed"], r["layer"], r["pos"], r["feature"], r["mismatch"]))
        if f is not None:
            where = "useful" if r["useful"] else "useless"
            balance[(r["task"], r["mismatch"], where)].append((f, r["R0_minus_RT_eval"], r["R0_eval"]))
    per_seed = stat_rows([{**r, "where": "useful" if r["useful"] else "useless"} for r in mismatch
                          if r["mismatch"] == "paper"], ("task", "where", "pos", "seed"), "offset_share_R0")
    offset_rows = stat_rows(per_seed, ("task", "where", "pos"), "mean")  # mean over features, then CI over seeds
    cell = defaultdict(list)
    for r in influence:
        cell[(r["task"], r["layer"], r["pos"], r["feature"], r["mismatch"], r["component"])].append(r["total"])
    for r in mismatch:
        key = (r["task"], r["layer"], r["pos"], r["feature"], r["mismatch"])
        cell[(*key, "removed")].append(r["R0_minus_RT_eval"])
        cell[(*key, "offset")].append(r["offset_share_R0"])
    site_rows = [{"task": t, "layer": k, "pos": i, "feature": f, "useful": u,
                  **{f"{m}_{c}": mean_of(cell.get((t, k, i, f, m, c), ()))
                     for m in MISMATCHES for c in (*COMPONENTS, "full", "removed")},
                  "offset_share": mean_of(cell.get((t, k, i, f, "paper", "offset"), ()))}
                 for (t, k, i, f, u) in sorted({(r["task"], r["layer"], r["pos"], r["feature"], r["useful"])
                                                for r in mismatch})]
    balance_rows = [{"task": t, "mismatch": m, "where": w,
                     "influence": mean_of(f for f, _, _ in v), "removed": mean_of(d for _, d, _ in v),
                     "R0": mean_of(r0 for _, _, r0 in v)} for (t, m, w), v in sorted(balance.items())]
    return offset_rows, balance_rows, site_rows


def _influence_curves(curves: list[dict], n_layer: int) -> list[dict]:
    """Cumulative influence curves (vanilla, useless sites below the last layer): per task × mismatch × component
    × step, stats over seeds of the mean over sites."""
    cacc = defaultdict(list)
    for r in curves:
        if _useless({**r, "useful": r.get("useful", r["pos"] >= 10)}, n_layer):
            cacc[(r["task"], r["mismatch"], r["component"], r["step"], r["seed"])].append(r["cumulative"])
    per_seed = defaultdict(lambda: defaultdict(list))
    for (t, m, c, step, s), v in cacc.items():
        per_seed[(t, m, c)][step].append(mean_of(v))
    return [{"task": t, "mismatch": m, "component": c, "step": step, **stats(v)}
            for (t, m, c), by_step in sorted(per_seed.items()) for step, v in sorted(by_step.items())]


def _settings(data: dict, n_seeds: int) -> list[dict]:
    per_task = data.get("task_train") or {}
    rows: list[dict] = [{"setting": "seeds", "this_run": str(n_seeds), "paper": PAPER_SETTINGS["seeds"]}]
    for r in train_settings(data.get("train") or {}, PAPER_SETTINGS):  # per task where they differ
        if vals := {t: v[r["setting"]] for t, v in per_task.items() if r["setting"] in v}:
            r["this_run"] = ", ".join(f"{t} {plain_number(v)}" for t, v in vals.items())
        rows.append(r)
    tracked = sites_text(data.get("sites") or []) if data.get("replays", True) else "none (replays skipped)"
    rows.append({"setting": "tracked sites", "this_run": tracked,
                 "paper": "layers 1–2 × positions 2–19"})
    if data.get("replays", True):
        rows += read_at_settings(data)
    for r in rows:
        r["differs"] = r["this_run"] != r["paper"]
    return rows


# ---------------------------------------------------------------------------------------------------- figures


def _fig_probe(task):
    def draw(summary):
        rows = [r for r in summary["probe_profiles"] if r["task"] == task]
        if not rows:
            return None
        layers, n = summary["probe_layers"], summary["n_seeds"]
        fig, axes = fs.figure(3.2 * len(layers), 3.2, 1, len(layers), sharey=True)
        for ax, k in zip(axes[0], layers):
            ax.axvspan(9.5, 20.5, color="#DDDDDD", alpha=0.5, lw=0)
            for g in summary["regimes"]:
                fs.mean_line(ax, select(rows, "pos", layer=k, weights="final", regime=g), "pos",
                             REGIME_COLORS.get(g, "#000000"), band=True, bounds=(-1, 1), lw=1.4, label=g)
            fs.mean_line(ax, select(rows, "pos", layer=k, weights="init"), "pos", fs.BASELINE, band=True,
                         bounds=(-1, 1), ls="--", lw=1.4, label="untrained (step 0)")
            ax.set_title(f"resid[{k}]" + (" (embeddings)" if k == 0 else f" (output of block {k - 1})"))
            ax.set_xlabel("position (grey: feature NTP-useful)")
        axes[0][0].set_ylabel("probe test Pearson r")
        feats = ", ".join(PROBE_FEATURES[task])
        fs.finish(fig, f"{TASK_TITLES[task]}: probe quality of {feats} (mean over features) by position; "
                       f"lines: mean, bands: {fs.ci_label(n, 'seeds')}{' (in Fisher z)' if n > 1 else ''}", ncol=5)
        return fig

    return draw


def _fig_task_success(summary):
    tasks, regimes = summary["tasks"], summary["regimes"]
    if not tasks:
        return None
    fig, axes = fs.figure(7.5, 3.2 * len(tasks), len(tasks), 2)
    for row, t in zip(axes, tasks):
        for ax, metric, label in ((row[0], "loss_gap", "eval loss − exact optimum (nats)"),
                                  (row[1], "first_acc", "first-output accuracy")):
            for x, g in enumerate(regimes):
                if (v := summary["task_success"][t].get(g)) is None:
                    continue
                ax.bar(x, v[metric]["mean"], color=REGIME_COLORS.get(g), alpha=0.75)
                ax.scatter([x] * len(v["per_seed"]), [s[metric] for s in v["per_seed"]], s=9, color="#000000",
                           zorder=3)
                fs.error_bars(ax, [x], [v[metric]], bounds=(0, 1) if metric == "first_acc" else None)
            gate = GATE_GAP if metric == "loss_gap" else GATE_ACC
            ax.axhline(gate, color=fs.BASELINE, ls="--", lw=1)
            ax.set_xticks(range(len(regimes)), regimes, rotation=15)
            ax.set_ylabel(label)
            ax.set_title(f"{TASK_TITLES[t]} (dashed: gate {gate})")
    fs.finish(fig, f"Did the models learn the tasks? Bars: mean, dots: seeds, whiskers: "
                   f"{fs.ci_label(summary['n_seeds'], 'seeds')} (accuracy clipped to [0, 1])")
    return fig


def _fig_learning(summary):
    learning = summary.get("learning") or {}
    if not (tasks := [t for t in summary["tasks"] if t in learning]):
        return None
    fig, axes = fs.figure(7.5, 3.0 * len(tasks), len(tasks), 2)
    for row, t in zip(axes, tasks):
        for ax, metric, label, gate in ((row[0], "loss_gap", "eval loss − exact optimum (nats)", GATE_GAP),
                                        (row[1], "first_acc", "first-output accuracy", GATE_ACC)):
            seeds = sorted({e["seed"] for e in learning[t]["curves"]})
            for sd, color in zip(seeds, fs.ordered_colors(len(seeds), "cividis")):
                ev = select(learning[t]["curves"], "step", seed=sd)
                ax.plot([e["step"] for e in ev], [e[metric] for e in ev], lw=1.2, label=f"seed {sd}", color=color)
            ax.axhline(gate, color=fs.BASELINE, ls="--", lw=1)
            if metric == "loss_gap":  # linear, zoomed on the gate: early (large) gaps are marked off scale
                ev = learning[t]["curves"]
                fs.mark_off_axis(ax, [e["step"] for e in ev], [e["loss_gap"] for e in ev],
                                 lo=min(0.0, *(e["loss_gap"] for e in ev)) - gate, hi=5 * gate)
            ax.set_xlabel("training step")
            ax.set_ylabel(label)
            ax.set_title(f"{TASK_TITLES[t]} (gate {gate})")
    fs.finish(fig, "Learning curves of the vanilla runs: every evaluation on held-out data, one line per seed; "
                   "loss gap on a linear axis zoomed on the gate (▲: evaluations above it)", ncol=5)
    return fig


def _fig_influence(summary, kind):
    """``kind`` "bars": integrated influence per component; "curves": cumulative influence over training."""
    rows = summary["influence_curves"]
    tasks = [t for t in summary["tasks"] if (t in summary["influence"] if kind == "bars" else select(rows, task=t))]
    if not tasks:
        return None
    fig, axes = fs.figure(7.5, 3.0 * len(tasks), len(tasks), 2)
    for row, t in zip(axes, tasks):
        for ax, m in zip(row, MISMATCHES):
            if kind == "bars":
                if (v := summary["influence"][t].get(m)) is None:
                    ax.set_visible(False)
                    continue
                xs = range(len(COMPONENTS))
                ax.bar(xs, [v[c]["mean"] or 0 for c in COMPONENTS], color=[fs.COMPONENT_COLORS[c] for c in COMPONENTS],
                       alpha=0.75)
                for x, c in zip(xs, COMPONENTS):
                    fs.seed_points(ax, x, v[c].get("per_seed") or [], width=0.3)
                fs.error_bars(ax, list(xs), [v[c] for c in COMPONENTS])
                ax.set_xticks(list(xs), [COMPONENT_LABELS[c] for c in COMPONENTS])
                ax.set_ylabel("integrated influence\n(probe units²)")
            else:
                for c in (*COMPONENTS, "full"):
                    fs.mean_line(ax, select(rows, task=t, mismatch=m, component=c), "step", fs.COMPONENT_COLORS[c],
                                 band=True, lw=1.4, ls=":" if c == "full" else "-", label=COMPONENT_LABELS[c])
                ax.set_xlabel("training step")
                ax.set_ylabel("cumulative influence\n(probe units²)")
            ax.axhline(0, color="#000000", lw=0.8)
            ax.set_title(f"{TASK_TITLES[t]}:\n{MISMATCH_LABELS[m]}")  # two lines: one would run past the panel
            if m == "centred":  # the mismatch claim c is decided on carries its precondition
                fs.account_note(ax, *account_text(*toy_influence_checks(summary, t)))
    if kind == "bars":
        n = min(v[c]["n"] for by in summary["influence"].values() for v in by.values() for c in COMPONENTS)
        fs.finish(fig, f"Which component built the NTP-useless feature? Vanilla, useless sites below the last layer; "
                       f"bars: mean, dots: seeds, whiskers: {fs.ci_label(n, 'seeds')}.\n{fs.SIGN}")
    else:
        fs.finish(fig, f"Cumulative influence at NTP-useless sites, vanilla; bands: "
                       f"{fs.ci_label(len(summary['tracked_seeds']), 'seeds')}. {fs.SIGN}", ncol=4)
    return fig


def _fig_gain(summary):
    """Claims a and b: every seed's gain of the window probe r over step 0, per task and regime, with mean and CI;
    on conditioned majority the equivalence margin of claim b."""
    pg = summary["probe_gain"]
    if not (tasks := [t for t in summary["tasks"] if t in pg]):
        return None
    fig, axes = fs.figure(max(6.0, 3.8 * len(tasks)), 3.6, 1, len(tasks))
    for ax, t in zip(axes[0], tasks):
        per = pg[t]["per_regime"]
        regimes = [g for g in summary["regimes"] if g in per]
        for x, g in enumerate(regimes):
            fs.seed_points(ax, x, per[g].get("gain_per_seed") or [], color=REGIME_COLORS.get(g), width=0.3)
            ax.plot([x - 0.2, x + 0.2], [per[g]["gain"]["mean"]] * 2, color="#000000", lw=1.5)
            fs.error_bars(ax, [x + 0.25], [per[g]["gain"]])
        ax.axhline(0, color="#000000", lw=0.6)
        if t == "cond_majority":  # claim b's one-sided margin: the whole interval at most B_MARGIN
            bottom, top = ax.get_ylim()
            ax.axhspan(bottom, B_MARGIN, color=fs.BASELINE, alpha=0.2, lw=0,
                       label=f"claim b's margin: a myopic regime's whole CI at most {B_MARGIN:g}")
            ax.set_ylim(bottom, max(top, B_MARGIN))
        ax.set_xticks(range(len(regimes)), regimes, rotation=15)
        ax.set_ylabel("gain of probe r over step 0\n(final − init, same seed)")
        ax.set_title(f"{TASK_TITLES[t]}: {', '.join(PROBE_FEATURES[t])}")
    seeded = any(v.get("gain_per_seed") for t in tasks for v in pg[t]["per_regime"].values())
    fs.finish(fig, f"Probe gain in the claims' window (layers 1–2, input positions 2–9). "
                   f"{'Dots: seeds; ' if seeded else 'Seeds not stored in this summary; '}line: mean; whisker: "
                   f"{fs.ci_label(summary['n_seeds'], 'seeds')}")
    return fig


def _fig_offset(summary):
    rows = summary["offset_share"]
    if not (tasks := [t for t in summary["tasks"] if any(r["task"] == t for r in rows)]):
        return None
    fig, axes = fs.figure(max(6.0, 3.6 * len(tasks)), 3.4, 1, len(tasks), sharey=True)
    for ax, t in zip(axes[0], tasks):
        sel = select(rows, "pos", task=t)
        xs = [r["pos"] for r in sel]
        ax.bar(xs, [r["mean"] for r in sel], color=[fs.BASELINE if r["where"] == "useful" else
                                                   fs.OKABE_ITO["vermillion"] for r in sel])
        fs.error_bars(ax, xs, sel, bounds=(0, 1))
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("tracked position (grey: feature NTP-useful)")
        ax.set_title(TASK_TITLES[t])
    axes[0][0].set_ylabel("offset share of R at step 0\nmean(d)² / R")
    fs.finish(fig, "How much of the paper's mismatch R is a mean offset at step 0? Held-out data, mean over "
                   f"features; whiskers: {fs.ci_label(len(summary['tracked_seeds']), 'seeds')}, clipped to [0, 1]")
    return fig


FIGURES = {"probe_majority": _fig_probe("majority"), "probe_cond_majority": _fig_probe("cond_majority"),
           "probe_gain": _fig_gain, "task_success": _fig_task_success, "learning_curves": _fig_learning, "influence_bars": lambda s: _fig_influence(s, "bars"),
           "influence_curves": lambda s: _fig_influence(s, "curves"), "offset_share": _fig_offset}


# ---------------------------------------------------------------------------------------------------- document


def _document(summary: dict, figures) -> list[tuple]:
    return template_blocks("toy", [c.to_dict() for c in toy_claims(summary)], s=summary, figures=figures, sign=fs.SIGN, unit=INFLUENCE_UNIT,
                           titles=TASK_TITLES)


def write_report(out_dir: str | Path) -> Path:
    """Read ``out_dir/data.json``; write figures/, summary.json, report.md and report.html. Returns report.md's path."""
    return write_from_data(out_dir, summarize, FIGURES, _document)


if __name__ == "__main__":
    report_main("toy_report", "toy", write_report)
