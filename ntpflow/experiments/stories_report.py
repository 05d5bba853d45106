"""Report of the TinyStories reproduction (docs/paper.md#tinystories, claim 4) from ``OUT/data.json``.

``write_report(out_dir)`` reads ``out_dir/data.json`` (``ntpflow.experiments.stories.run_stories``; schema in
docs/outputs.md) and writes ``figures/``, ``summary.json``, ``report.md`` and ``report.html`` (claims table
``id="claims"``, samples ``id="samples"``). Layer k = output of block k − 1 (docs/conventions.md); positions are
window positions (no BOS). Statistics: the seed is the unit of replication (95% t-intervals over seeds). Influence
*shares*: per (site, feature) each component's integrated influence divided by |direct| + |pre-cached| + |shared|, so
features on very different scales (``pos_int`` is in tokens, the tags are 0/1) weigh alike; then averaged over the
group's (site, feature) pairs per seed. Sign convention: positive influence = the component moved the feature toward
its final value. The same data.json gives byte-identical md/html/json.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ntpflow.experiments import figure_style as fs
from ntpflow.experiments.claim_registry import PAPER_LOSS, account_text, stories_claims, stories_influence_checks
from ntpflow.experiments.formats import (
    COMPONENT_LABELS,
    COMPONENTS,
    mismatch_summary,
    read_at_settings,
    select,
    sites_text,
    train_settings,
)
from ntpflow.experiments.render import report_main, template_blocks, write_from_data
from ntpflow.replay.summary import residual_share
from ntpflow.stats import mean_of, paired, stat_rows, stats
from ntpflow.tasks.stories.corpus import SAMPLE_SHA256

REGIMES = ("vanilla", "myopic")
GROUPS = ("tags", "deps", "position", "syntax")  # "syntax" = tags + deps, added by summarize
PLOT_GROUPS = ("tags", "deps", "position")
GROUP_LABELS = {"tags": "POS tags (10)", "deps": "dependency labels (10)", "position": "story position (2)",
                "syntax": "syntax: tags + deps (20)"}
ALL_COMPONENTS = COMPONENTS + ("full",)
REGIME_COLORS = {**{r: fs.REGIME_COLORS[r] for r in REGIMES}, "init": fs.BASELINE}
INFLUENCE_UNIT = "squared probe units (the decrease of the squared probe mismatch R that the component caused)"
PAPER_SETTINGS = {"corpus": "TinyStoriesV2-GPT4 (hub)", "tokenizer": "TinyStories-1M (GPT-Neo BPE, 50,257)",
                  "seeds": "10", "steps": "1000", "batch_size": "256", "lr": "0.001", "n_layer": "4",
                  "d_model": "128", "n_head": "4", "n_train": "300000", "n_eval": "30000",
                  "sites": "layers 1–4 × positions 30–39"}


# ---------------------------------------------------------------------------------------------------- summary


def _corpus_text(corpus) -> str:
    """The corpus source as the report shows it: the shipped sample by its folder, licence and hashes; a local folder
    by its name only (the path is the user's machine's)."""
    c = str(corpus or "?")
    if c == "sample":
        hashes = ", ".join(f"{name} {digest[:12]}…" for name, digest in SAMPLE_SHA256.items())
        return f"ntpflow/data/tinystories-sample, shipped in the package, CDLA-Sharing-1.0, SHA-256 {hashes}"
    keep = c in ("hf", "?") or c.startswith(("hf:", "generated", "local folder", "ntpflow/data/tinystories-sample",
                                             "data/tinystories-sample"))
    return c if keep else f"local folder '{Path(c).name}'"


def _settings(data: dict, seeds) -> list[dict]:
    tok = data.get("tokenizer") or {}
    tok_text = (f"{tok.get('name') or 'hub'} (hub)" if tok.get("source") == "hub"
                else f"byte-level BPE trained offline on the training split, {tok.get('vocab_size')} tokens")
    rows: list[dict] = [{"setting": "scale", "this_run": str(data.get("scale", "?")), "paper": "paper"},
            {"setting": "corpus", "this_run": _corpus_text(data.get("corpus")), "paper": PAPER_SETTINGS["corpus"]},
            {"setting": "tokenizer", "this_run": tok_text, "paper": PAPER_SETTINGS["tokenizer"]},
            {"setting": "seeds", "this_run": f"{len(seeds)} ({', '.join(str(s) for s in seeds)})",
             "paper": PAPER_SETTINGS["seeds"]}]
    rows += train_settings(data.get("train") or {}, PAPER_SETTINGS)
    rows.append({"setting": "sites", "this_run": sites_text(data.get("sites") or []), "paper": PAPER_SETTINGS["sites"]})
    rows += read_at_settings(data)
    for r in rows:
        r["differs"] = r["setting"] != "scale" and r["this_run"].split(" (")[0] != r["paper"].split(" (")[0]
    return rows


def summarize(data: dict) -> dict:
    """Every aggregate of the report and the claims table, from the parsed data.json (pure, no I/O)."""
    runs, probes = data.get("runs") or [], data.get("probes") or []
    profiles, influence, curves = data.get("profiles") or [], data.get("influence") or [], data.get("curves") or []
    records = runs + probes + influence
    regimes = [r for r in REGIMES if any(x["regime"] == r for x in records)]
    seeds = sorted({r["seed"] for r in records} | set(data.get("seeds") or []))
    n_layer = data.get("n_layer") or max([p["layer"] for p in probes] or [0])
    layers = list(range(1, n_layer + 1))
    groups = _groups(data.get("feature_groups") or {})
    init_rg = regimes[0] if regimes else None  # the untrained profile: of the first regime's step-0 weights
    profile_rows = stat_rows([{**p, "regime": "init" if p["weights"] == "init" else p["regime"]} for p in profiles
                              if p["layer"] in layers and (p["weights"] != "init" or p["regime"] == init_rg)],
                             ("group", "regime", "layer", "pos"), "r")
    # R_c and R per regime × layer × feature, mean over its tracked positions and seeds (old: mismatch_removed)
    mismatch = data.get("mismatch") or [{**r, "mismatch": "paper", "R0_minus_RT_eval": r["total"]} for r in influence
                                        if r["component"] == "mismatch_removed"]
    by_mismatch = mismatch_summary(influence, data.get("influence_centred"), mismatch, ("regime", "layer", "feature"))
    # influence curves: mean over site × features of the group; stats over seeds
    curve_rows = stat_rows([r for r in curves if r["component"] in ALL_COMPONENTS],
                           ("group", "regime", "component", "step"), "cumulative")
    summary = {
        "scale": data.get("scale"), "corpus": _corpus_text(data.get("corpus")), "tokenizer": data.get("tokenizer") or {},
        "seeds": seeds, "n_seeds": len(seeds), "regimes": regimes, "sites": data.get("sites") or [],
        "train": data.get("train") or {}, "layers": layers, "feature_groups": groups,
        "settings": _settings(data, seeds), "sign_convention": fs.SIGN, "influence_unit": INFLUENCE_UNIT,
        "ci": "two-sided 95% Student-t interval over seeds; lo/hi are null when n < 2",
        "loss": _loss(runs, regimes), "probe_quality": _probe_quality(probes, groups, regimes, seeds, layers),
        "probe_per_feature": _probe_per_feature(probes, groups, regimes, seeds, layers),
        "probe_profiles": profile_rows, "influence": _influence(influence, groups, regimes, seeds, data.get("influence_sgd")),
        "optimizer": data.get("optimizer", "adam"),
        "influence_curves": curve_rows, **by_mismatch, "samples": data.get("samples") or None,
        "exact_account": {g: residual_share(r for r in mismatch if r.get("regime") == "vanilla"
                                            and r["mismatch"] == "paper" and r["feature"] in members)
                          for g, members in groups.items()},
    }
    summary["claims"] = [c.to_dict() for c in stories_claims(summary)]
    return summary


def _groups(raw: dict) -> dict:
    """The feature groups in plot order, with "syntax" (tags + deps, for claims b and c) where both are there."""
    groups = {g: raw[g] for g in [*(g for g in PLOT_GROUPS if g in raw), *sorted(set(raw) - set(PLOT_GROUPS))]}
    if "tags" in groups and "deps" in groups:
        groups["syntax"] = list(groups["tags"]) + list(groups["deps"])
    return groups


def _loss(runs: list[dict], regimes: list[str]) -> dict:
    """The paper's losses, ours per regime (stats over seeds) and the paired myopic − vanilla difference."""
    loss = {"paper": {rg: {"mean": m, "sd": sd} for rg, (m, sd) in PAPER_LOSS.items()}, "per_regime": {}}
    per_seed_loss = {rg: {r["seed"]: r.get("eval_loss") for r in runs if r["regime"] == rg} for rg in regimes}
    for rg in regimes:
        sel = [r for r in runs if r["regime"] == rg]
        loss["per_regime"][rg] = {"eval_loss": stats(r.get("eval_loss") for r in sel),
                                  "train_loss": stats(r.get("train_loss") for r in sel),
                                  "per_seed": [{"seed": r["seed"], "eval_loss": r.get("eval_loss")} for r in sel]}
    if "vanilla" in regimes and "myopic" in regimes:
        loss["myopic_minus_vanilla"] = paired(per_seed_loss["myopic"], per_seed_loss["vanilla"])
    return loss


def _probe_r(probes: list[dict]) -> dict:
    """``{(regime, seed, weights, layer, feature): r_mean}``."""
    return {(p["regime"], p["seed"], p["weights"], p["layer"], p["feature"]): p.get("r_mean") for p in probes}


def _probe_quality(probes: list[dict], groups: dict, regimes, seeds, layers) -> dict:
    """Probe quality per group: the mean over the group's features and layers 1..L of r_mean, per seed; stats over
    seeds per regime and layer, the gain over step 0 and the paired vanilla − myopic difference."""
    r_at = _probe_r(probes)

    def q(regime, seed, weights, group, lays=None):
        return mean_of(r_at.get((regime, seed, weights, k, f)) for k in (lays or layers) for f in groups.get(group, ()))

    probe_quality = {}
    for g, members in groups.items():
        entry = {"features": list(members), "layers": layers, "per_regime": {}, "per_layer": {}}
        per = {}
        for rg in regimes:
            fin = {s: q(rg, s, "final", g) for s in seeds}
            ini = {s: q(rg, s, "init", g) for s in seeds}
            gain = {s: f - i for s, f, i in ((s, fin[s], ini[s]) for s in seeds) if f is not None and i is not None}
            per[rg] = fin
            entry["per_regime"][rg] = {"final": stats(fin.values()), "init": stats(ini.values()),
                                       "gain": stats(gain.values()), "gain_per_seed": gain}
            entry["per_layer"][rg] = {str(k): stats(q(rg, s, "final", g, [k]) for s in seeds) for k in layers}
        init_rg = "vanilla" if "vanilla" in regimes else (regimes[0] if regimes else None)
        if init_rg:
            entry["per_layer"]["init"] = {str(k): stats(q(init_rg, s, "init", g, [k]) for s in seeds) for k in layers}
            entry["init"] = entry["per_regime"][init_rg]["init"]
        if "vanilla" in per and "myopic" in per:
            entry["vanilla_minus_myopic"] = paired(per["vanilla"], per["myopic"])
        probe_quality[g] = entry
    return probe_quality


def _probe_per_feature(probes: list[dict], groups: dict, regimes, seeds, layers) -> list[dict]:
    """Per feature (of the base groups): stats over seeds of its mean r over layers, per regime and at step 0."""
    r_at = _probe_r(probes)
    per_feature = []
    base = [g for g in groups if g != "syntax"]
    for f in [f for g in base for f in groups[g]]:
        row = {"feature": f, "group": next(g for g in base if f in groups[g])}
        for rg in regimes:
            row[rg] = stats(mean_of(r_at.get((rg, s, "final", k, f)) for k in layers) for s in seeds)
        if regimes:
            row["init"] = stats(mean_of(r_at.get((regimes[0], s, "init", k, f)) for k in layers) for s in seeds)
        per_feature.append(row)
    return per_feature


def _shares(tot: dict, regime: str, seed: int, pairs: list) -> dict:
    """Per component, the mean over ``pairs`` (site × feature) of its share of |direct| + |pre-cached| + |shared|
    (pairs with a non-finite component skipped)."""
    sh = defaultdict(list)
    for x in pairs:
        v = {c: tot.get((regime, seed, *x, c)) for c in COMPONENTS}
        v = {c: u for c, u in v.items() if u is not None and math.isfinite(u)}
        if len(v) < len(COMPONENTS):  # one is None or not finite
            continue
        den = sum(abs(v[c]) for c in COMPONENTS)
        if den > 0:
            for c in COMPONENTS:
                sh[c].append(v[c] / den)
    return {c: mean_of(sh[c]) for c in COMPONENTS}


def _influence(influence: list[dict], groups: dict, regimes, seeds, sgd: list[dict] | None = None) -> dict:
    """Integrated influence per group and component, raw (with ``per_seed`` in seed order) and as shares (stats over
    seeds), with the paired differences of the shares; ``sgd_raw`` the same raw totals of the SGD direction where the
    replays kept it (``sgd``: its records)."""
    tot = {}
    for r in influence:
        tot[(r["regime"], r["seed"], r["layer"], r["pos"], r["feature"], r["component"])] = r["total"]
    for r in sgd or ():
        tot[(r["regime"], r["seed"], r["layer"], r["pos"], r["feature"], "sgd:" + r["component"])] = r["total"]
    pairs = sorted({(r["layer"], r["pos"], r["feature"]) for r in influence if r["component"] in COMPONENTS})
    infl = {}
    for g, members in groups.items():
        gp = [x for x in pairs if x[2] in members]
        if not gp:
            continue
        entry = {"n_site_features": len(gp), "per_regime": {}}
        for rg in regimes:
            raw = {c: {} for c in ALL_COMPONENTS + ("mismatch_removed",)}
            share = {c: {} for c in COMPONENTS}
            for s in seeds:
                for c, per_seed in raw.items():
                    per_seed[s] = mean_of(tot.get((rg, s, *x, c)) for x in gp)
                for c, v in _shares(tot, rg, s, gp).items():
                    share[c][s] = v
            if not any(v is not None for v in raw["full"].values()):
                continue
            sgd_raw = {c: {s: mean_of(tot.get((rg, s, *x, "sgd:" + c)) for x in gp) for s in seeds}
                       for c in ALL_COMPONENTS}
            entry["per_regime"][rg] = {
                "raw": {c: {**stats(raw[c].values()), "per_seed": [raw[c][s] for s in seeds]} for c in raw},
                **({"sgd_raw": {c: {**stats(sgd_raw[c].values()), "per_seed": [sgd_raw[c][s] for s in seeds]}
                                for c in ALL_COMPONENTS}}
                   if all(v is not None for per in sgd_raw.values() for v in per.values()) else {}),
                "share": {c: stats(share[c].values()) for c in COMPONENTS},
                "direct_minus_pre_cached_share": paired(share["direct"], share["pre_cached"]),
                "pre_cached_minus_direct_share": paired(share["pre_cached"], share["direct"]),
                "direct_minus_shared_share": paired(share["direct"], share["shared"]),
            }
        infl[g] = entry
    return infl


# ---------------------------------------------------------------------------------------------------- figures


def _fig_loss(summary):
    """Ours (left): bars of the mean with every seed as a dot and ± sd whiskers. The paper's (right, its own axis:
    second-hand mean ± sd of another tokenizer and corpus size): interval marks only."""
    if not (per := summary["loss"]["per_regime"]):
        return None
    regimes = [rg for rg in REGIMES if rg in per]
    fig, axes = fs.figure(8.4, 4.2, 1, 2)
    ours, paper = axes[0]
    for i, rg in enumerate(regimes):
        s = per[rg]["eval_loss"]
        if s["mean"] is not None:
            ours.bar(i, s["mean"], 0.6, color=REGIME_COLORS[rg], alpha=0.75)
            if s["sd"] is not None:
                ours.errorbar([i], [s["mean"]], yerr=[s["sd"]], fmt="none", ecolor="#000000", capsize=3)
            fs.seed_points(ours, i, [r["eval_loss"] for r in per[rg]["per_seed"]], width=0.3)
            ours.text(i, s["mean"] / 2, f"{s['mean']:.2f}", ha="center", color="white", fontsize=9)
    pm = [PAPER_LOSS[rg] for rg in regimes]
    for i, rg in enumerate(regimes):
        fs.paper_intervals(paper, [i], [(pm[i][0] - pm[i][1], pm[i][0] + pm[i][1])], color=REGIME_COLORS[rg],
                           label=None)
        paper.text(i + 0.08, pm[i][0], f"{pm[i][0]:.2f} ± {pm[i][1]:.2f}", va="center", fontsize=9)
    for ax in (ours, paper):
        ax.set_xticks(range(len(regimes)), regimes)
        ax.set_xlim(-0.6, len(regimes) - 0.4)
        ax.grid(axis="x", visible=False)
    ours.set_ylabel("held-out loss, this run (nats/token)")
    paper.set_ylabel("the paper's held-out loss (nats/token;\nits tokenizer and corpus; second-hand)")
    ours.set_title("this run: mean (bar), seeds (dots), ± sd", fontsize=9)
    paper.set_title("paper: mean ± sd (presumably), 10 seeds", fontsize=9)
    fs.finish(fig, "Held-out loss: this run (left) and the paper (right, on its own axis)")
    return fig


def _grouped_bars(ax, groups, series):
    """Bars of ``series`` [(label, color, [stats per group])] side by side per group, whiskers clipped to [−1, 1]."""
    w = 0.8 / len(series)
    for j, (label, color, ss) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * w for i in range(len(groups))]
        ax.bar(xs, [s["mean"] or 0.0 for s in ss], w, color=color, label=label)
        fs.error_bars(ax, xs, ss, bounds=(-1.0, 1.0))
    ax.axhline(0, color="#000000", lw=0.6)
    ax.grid(axis="x", visible=False)


def _fig_probe_groups(summary):
    pq = summary["probe_quality"]
    if not (groups := [g for g in PLOT_GROUPS if g in pq]):
        return None
    fig, axes = fs.figure(7.2, 4.3)
    ax = axes[0][0]
    _grouped_bars(ax, groups, [("untrained (init)", REGIME_COLORS["init"], [pq[g]["init"] for g in groups])]
                  + [(rg, REGIME_COLORS[rg], [pq[g]["per_regime"][rg]["final"] for g in groups])
                     for rg in summary["regimes"]])
    ax.set_xticks(range(len(groups)), [GROUP_LABELS[g] for g in groups])
    ax.set_ylabel("probe test Pearson r\n(mean over features, layers 1–L, positions 1–63)")
    fs.finish(fig, f"Probe quality per feature group (whiskers: {fs.ci_label(summary['n_seeds'], 'seeds')}, clipped "
                   "to [−1, 1])", ncol=1 + len(summary["regimes"]))
    return fig


def _fig_influence_shares(summary):
    infl = summary["influence"]
    groups = [g for g in PLOT_GROUPS if g in infl]
    regimes = [rg for rg in summary["regimes"] if any(rg in infl[g]["per_regime"] for g in groups)]
    if not groups or not regimes:
        return None
    fig, axes = fs.figure(4.6 * len(regimes) + 1.0, 4.4, 1, len(regimes), sharey=True)
    for ax, rg in zip(axes[0], regimes):
        _grouped_bars(ax, groups, [(COMPONENT_LABELS[c], fs.COMPONENT_COLORS[c],
                                    [infl[g]["per_regime"].get(rg, {}).get("share", {}).get(c) or stats([])
                                     for g in groups]) for c in COMPONENTS])
        ax.set_xticks(range(len(groups)), [GROUP_LABELS[g].split(" (")[0] for g in groups])
        ax.set_title(rg)
        if rg == "vanilla":  # the claims (c, d) rest on the vanilla runs' decomposition
            _account_notes(ax, summary)
    axes[0][0].set_ylabel("influence share\ncomponent / (|direct| + |pre-cached| + |shared|)")
    fs.finish(fig, "Integrated Adam influence per component at the tracked sites (whiskers: "
                   f"{fs.ci_label(summary['n_seeds'], 'seeds')}, clipped to [−1, 1])\n{fs.SIGN}", ncol=len(COMPONENTS))
    return fig


def _account_notes(ax, summary, groups=("syntax", "position")):
    """The account of the claims' decompositions (c: syntax, d: position) in one note on ``ax``."""
    parts = [(g, *account_text(*stories_influence_checks(summary, g))) for g in groups]
    fs.account_note(ax, "\n".join(f"{g}: {text}{'' if ok else ' (fails)'}" for g, text, ok in parts),
                    all(ok for _, _, ok in parts))


def _panels(groups, columns, width, extra_height, xlabel, ylabel):
    """One panel per group (row) × column [(key, title text)], x shared, y shared along each row, labels on the outer
    edges; returns the figure and [(axes, group, key)]."""
    fig, axes = fs.figure(width, 2.5 * len(groups) + extra_height, len(groups), len(columns), sharex=True)
    panels = []
    for i, g in enumerate(groups):
        for j, (key, text) in enumerate(columns):
            ax = axes[i][j]
            if j > 0:
                ax.sharey(axes[i][0])
                ax.tick_params(labelleft=False)
            ax.set_title(f"{GROUP_LABELS[g]} · {text}", fontsize=9)
            panels.append((ax, g, key))
        axes[i][0].set_ylabel(ylabel)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    return fig, panels


def _fig_probe_profiles(summary):
    rows, layers = summary["probe_profiles"], summary["layers"]
    groups = [g for g in PLOT_GROUPS if select(rows, group=g)]
    if not groups or not layers:
        return None
    fig, panels = _panels(groups, [(k, f"layer {k}") for k in layers], 2.9 * len(layers) + 1.0, 1.6,
                          "window position", "probe r")
    for ax, g, k in panels:
        for key in ("init", *summary["regimes"]):
            fs.mean_line(ax, select(rows, "pos", group=g, regime=key, layer=k), "pos", REGIME_COLORS[key],
                         band=key != "init", bounds=(-1.0, 1.0), lw=1.0 if key == "init" else 1.5,
                         ls="--" if key == "init" else "-", label="untrained (init)" if key == "init" else key)
        for layer_, pos in summary["sites"]:
            if layer_ == k:
                ax.axvline(pos, color="#BBBBBB", lw=0.6, zorder=0)
    fs.finish(fig, "Probe quality along the window (mean over the group's features)\nbands: "
                   f"{fs.ci_label(summary['n_seeds'], 'seeds')}, clipped to [−1, 1]; thin grey lines: tracked sites",
              ncol=1 + len(summary["regimes"]))
    return fig


def _fig_influence_curves(summary):
    from matplotlib.ticker import MaxNLocator

    rows = summary["influence_curves"]
    groups = [g for g in PLOT_GROUPS if select(rows, group=g)]
    regimes = [rg for rg in summary["regimes"] if select(rows, regime=rg)]
    if not groups or not regimes:
        return None
    fig, panels = _panels(groups, [(rg, rg) for rg in regimes], 3.6 * len(regimes) + 1.1, 1.5, "training step",
                          "cumulative influence\n(squared probe units;\n+ = toward final value)")
    for ax, g, rg in panels:
        ax.axhline(0, color="#000000", lw=0.6)
        if rg == "vanilla" and g in ("tags", "deps", "position"):
            _account_notes(ax, summary, ("syntax",) if g != "position" else ("position",))
        for c in ALL_COMPONENTS:
            fs.mean_line(ax, select(rows, "step", group=g, regime=rg, component=c), "step", fs.COMPONENT_COLORS[c],
                         band=c != "full", lw=1.1 if c == "full" else 1.6, ls="--" if c == "full" else "-",
                         label=COMPONENT_LABELS[c])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fs.finish(fig, "Cumulative Adam influence (mean over tracked sites × the group's features; bands: "
                   f"{fs.ci_label(summary['n_seeds'], 'seeds')})\n{fs.SIGN}", ncol=len(ALL_COMPONENTS))
    return fig


FIGURES = {"loss": _fig_loss, "probe_groups": _fig_probe_groups, "probe_profiles": _fig_probe_profiles,
           "influence_shares": _fig_influence_shares, "influence_curves": _fig_influence_curves}


# ---------------------------------------------------------------------------------------------------- document


def _document(summary: dict, figures) -> list[tuple]:
    settings = [{**r, "this_run": _corpus_text(r["this_run"])} if r["setting"] == "corpus" else r
                for r in summary["settings"]]
    return template_blocks("stories", [c.to_dict() for c in stories_claims(summary)], s=summary, settings=settings,
                           corpus=_corpus_text(summary["corpus"]), ci_label=fs.ci_label(summary["n_seeds"], "seeds"),
                           sign=fs.SIGN, unit=INFLUENCE_UNIT, regimes=REGIMES, groups=GROUPS, group_labels=GROUP_LABELS,
                           components=COMPONENTS, all_components=ALL_COMPONENTS, paper_loss=PAPER_LOSS)


# ---------------------------------------------------------------------------------------------------- entry point


def write_report(out_dir: str | Path) -> Path:
    """Read ``out_dir/data.json``; write figures/, summary.json, report.md and report.html. Returns report.md's path."""
    return write_from_data(out_dir, summarize, FIGURES, _document)


if __name__ == "__main__":
    report_main("stories_report", "TinyStories", write_report)
