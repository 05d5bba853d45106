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

from .claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, Claim, Rule, at_least, every, interval_above
from .report_kit import (
    RC,
    draw_figures,
    fmt,
    fmt_ci,
    fmt_g,
    mean_of,
    report_main,
    save_figure,
    stats,
    write_from_data,
)
from .figure_style import ci_label, error_bars
from .report_kit import ci_band as _band
from .report_kit import figure_grid as _grid
from .report_kit import finish_figure as _finish
from .report_kit import (
    plain_number as _plain,
)
from .report_kit import (
    sites_text as _sites_text,
)

REGIMES = ("vanilla", "myopic")
GROUPS = ("tags", "deps", "position", "syntax")  # "syntax" = tags + deps, added by summarize
PLOT_GROUPS = ("tags", "deps", "position")
GROUP_LABELS = {"tags": "POS tags (10)", "deps": "dependency labels (10)", "position": "story position (2)",
                "syntax": "syntax: tags + deps (20)"}
COMPONENTS = ("direct", "pre_cached", "shared")
ALL_COMPONENTS = COMPONENTS + ("full",)
COMPONENT_LABELS = {"direct": "direct", "pre_cached": "pre-cached", "shared": "shared", "full": "full (= sum)"}
REGIME_COLORS = {"vanilla": "#0072B2", "myopic": "#D55E00", "init": "#7F7F7F"}
COMPONENT_COLORS = {"direct": "#E69F00", "pre_cached": "#56B4E9", "shared": "#6A3D9A", "full": "#333333"}
PAPER_LOSS = {"vanilla": (2.53, 0.10), "myopic": (3.29, 0.02)}  # docs/paper.md#numbers: mean ± (presumably) sd, 10 seeds

SIGN = "Sign convention: positive influence = the component moved the feature toward its final value."
INFLUENCE_UNIT = "squared probe units (first-order reduction of the batch-mean squared probe mismatch)"

A_REL = 0.02  # claim a: "clearly worse" = at least 2% above vanilla's mean loss
B_KEEP = 0.8  # claim b: myopic keeps >= 80% of vanilla's probe gain over init
B_LOSE = 0.5  # claim b: not reproduced if myopic significantly loses more than half of it

PAPER_SETTINGS = {"corpus": "TinyStoriesV2-GPT4 (hub)", "tokenizer": "TinyStories-1M (GPT-Neo BPE, 50,257)",
                  "seeds": "10", "steps": "1000", "batch_size": "256", "lr": "0.001", "n_layer": "4",
                  "d_model": "128", "n_head": "4", "n_train": "300000", "n_eval": "30000",
                  "sites": "layers 1–4 × positions 30–39"}
SETTING_KEYS = ("steps", "batch_size", "lr", "n_layer", "d_model", "n_head", "n_train", "n_eval")


# ---------------------------------------------------------------------------------------------------- summary


def _corpus_text(corpus) -> str:
    """The corpus source as the report shows it: a local folder by its name only (the path is the user's machine's)."""
    c = str(corpus or "?")
    keep = c in ("hf", "?") or c.startswith(("hf:", "generated", "local folder"))
    return c if keep else f"local folder '{Path(c).name}'"


def _settings(data: dict, seeds) -> list[dict]:
    from dataclasses import fields

    from ..config import TrainConfig

    defaults = {f.name: f.default for f in fields(TrainConfig)}
    train = data.get("train") or {}
    tok = data.get("tokenizer") or {}
    tok_text = (f"{tok.get('name') or 'hub'} (hub)" if tok.get("source") == "hub"
                else f"byte-level BPE trained offline on the training split, {tok.get('vocab_size')} tokens")
    rows = [{"setting": "scale", "this_run": str(data.get("scale", "?")), "paper": "paper"},
            {"setting": "corpus", "this_run": _corpus_text(data.get("corpus")), "paper": PAPER_SETTINGS["corpus"]},
            {"setting": "tokenizer", "this_run": tok_text, "paper": PAPER_SETTINGS["tokenizer"]},
            {"setting": "seeds", "this_run": f"{len(seeds)} ({', '.join(str(s) for s in seeds)})",
             "paper": PAPER_SETTINGS["seeds"]}]
    for k in SETTING_KEYS:
        rows.append({"setting": k, "this_run": _plain(train.get(k, defaults.get(k))), "paper": PAPER_SETTINGS[k]})
    rows.append({"setting": "sites", "this_run": _sites_text(data.get("sites") or []),
                 "paper": PAPER_SETTINGS["sites"]})
    for r in rows:
        r["differs"] = r["setting"] != "scale" and r["this_run"].split(" (")[0] != r["paper"].split(" (")[0]
    return rows


def _paired(a: dict, b: dict) -> dict:
    """Stats of a[s] − b[s] over the seeds present (finite) in both."""
    return stats(a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None)


def summarize(data: dict) -> dict:
    """Every aggregate of the report and the claims table, from the parsed data.json (pure, no I/O)."""
    runs, probes = data.get("runs") or [], data.get("probes") or []
    profiles, influence, curves = data.get("profiles") or [], data.get("influence") or [], data.get("curves") or []
    records = runs + probes + influence
    regimes = [r for r in REGIMES if any(x["regime"] == r for x in records)]
    seeds = sorted({r["seed"] for r in records} | set(data.get("seeds") or []))
    n_layer = data.get("n_layer") or max([p["layer"] for p in probes] or [0])
    layers = list(range(1, n_layer + 1))
    raw_groups = data.get("feature_groups") or {}
    groups = {g: raw_groups[g] for g in [*(g for g in PLOT_GROUPS if g in raw_groups), *sorted(set(raw_groups) -
                                                                                               set(PLOT_GROUPS))]}
    if "tags" in groups and "deps" in groups:  # the 20 syntactic features together, for claims b and c
        groups["syntax"] = list(groups["tags"]) + list(groups["deps"])

    # ---- loss
    loss = {"paper": {rg: {"mean": m, "sd": sd} for rg, (m, sd) in PAPER_LOSS.items()}, "per_regime": {}}
    per_seed_loss = {rg: {r["seed"]: r.get("eval_loss") for r in runs if r["regime"] == rg} for rg in regimes}
    for rg in regimes:
        sel = [r for r in runs if r["regime"] == rg]
        loss["per_regime"][rg] = {"eval_loss": stats(r.get("eval_loss") for r in sel),
                                  "train_loss": stats(r.get("train_loss") for r in sel),
                                  "per_seed": [{"seed": r["seed"], "eval_loss": r.get("eval_loss")} for r in sel]}
    if "vanilla" in regimes and "myopic" in regimes:
        loss["myopic_minus_vanilla"] = _paired(per_seed_loss["myopic"], per_seed_loss["vanilla"])

    # ---- probe quality per group: mean over the group's features and layers 1..L of r_mean, per seed
    r_at = {(p["regime"], p["seed"], p["weights"], p["layer"], p["feature"]): p.get("r_mean") for p in probes}

    def q(regime, seed, weights, group, lays=None):
        return mean_of(r_at.get((regime, seed, weights, k, f)) for k in (lays or layers) for f in groups.get(group, ()))

    probe_quality = {}
    for g, members in groups.items():
        entry = {"features": list(members), "layers": layers, "per_regime": {}, "per_layer": {}}
        per = {}
        for rg in regimes:
            fin = {s: q(rg, s, "final", g) for s in seeds}
            ini = {s: q(rg, s, "init", g) for s in seeds}
            gain = {s: fin[s] - ini[s] for s in seeds if fin[s] is not None and ini[s] is not None}
            per[rg] = fin
            entry["per_regime"][rg] = {"final": stats(fin.values()), "init": stats(ini.values()),
                                       "gain": stats(gain.values()), "gain_per_seed": gain}
            entry["per_layer"][rg] = {str(k): stats(q(rg, s, "final", g, [k]) for s in seeds) for k in layers}
        init_rg = "vanilla" if "vanilla" in regimes else (regimes[0] if regimes else None)
        if init_rg:
            entry["per_layer"]["init"] = {str(k): stats(q(init_rg, s, "init", g, [k]) for s in seeds) for k in layers}
            entry["init"] = entry["per_regime"][init_rg]["init"]
        if "vanilla" in per and "myopic" in per:
            entry["vanilla_minus_myopic"] = _paired(per["vanilla"], per["myopic"])
        probe_quality[g] = entry

    per_feature = []
    base = [g for g in groups if g != "syntax"]
    for f in [f for g in base for f in groups[g]]:
        row = {"feature": f, "group": next(g for g in base if f in groups[g])}
        for rg in regimes:
            row[rg] = stats(mean_of(r_at.get((rg, s, "final", k, f)) for k in layers) for s in seeds)
        if regimes:
            row["init"] = stats(mean_of(r_at.get((regimes[0], s, "init", k, f)) for k in layers) for s in seeds)
        per_feature.append(row)

    prof = defaultdict(list)
    for p in profiles:
        if p["layer"] in layers:
            key_rg = "init" if p["weights"] == "init" else p["regime"]
            if p["weights"] == "init" and p["regime"] != (regimes[0] if regimes else None):
                continue
            prof[(p["group"], key_rg, p["layer"], p["pos"])].append(p["r"])
    profile_rows = [{"group": g, "regime": rg, "layer": k, "pos": pos, **stats(v)}
                    for (g, rg, k, pos), v in sorted(prof.items(), key=lambda x: (str(x[0][0]), x[0][1:]))]

    # ---- integrated influence per group and component (raw, and shares)
    tot = {}
    for r in influence:
        tot[(r["regime"], r["seed"], r["layer"], r["pos"], r["feature"], r["component"])] = r["total"]
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
                sh = defaultdict(list)
                for x in gp:
                    v = {c: tot.get((rg, s, *x, c)) for c in COMPONENTS}
                    if any(v[c] is None or not math.isfinite(v[c]) for c in COMPONENTS):
                        continue
                    den = sum(abs(v[c]) for c in COMPONENTS)
                    if den > 0:
                        for c in COMPONENTS:
                            sh[c].append(v[c] / den)
                for c in COMPONENTS:
                    share[c][s] = mean_of(sh[c])
            if not any(v is not None for v in raw["full"].values()):
                continue
            entry["per_regime"][rg] = {
                "raw": {c: stats(raw[c].values()) for c in raw},
                "share": {c: stats(share[c].values()) for c in COMPONENTS},
                "direct_minus_pre_cached_share": _paired(share["direct"], share["pre_cached"]),
                "pre_cached_minus_direct_share": _paired(share["pre_cached"], share["direct"]),
                "direct_minus_shared_share": _paired(share["direct"], share["shared"]),
            }
        infl[g] = entry

    # ---- influence curves (mean over site × features of the group; stats over seeds)
    cacc = defaultdict(list)
    for r in curves:
        if r["component"] in ALL_COMPONENTS:
            cacc[(r["group"], r["regime"], r["component"], r["step"])].append(r["cumulative"])
    curve_rows = [{"group": g, "regime": rg, "component": c, "step": st, **stats(v)}
                  for (g, rg, c, st), v in sorted(cacc.items(), key=lambda x: (str(x[0][0]), x[0][1:]))]

    samples = data.get("samples") or None
    summary = {
        "scale": data.get("scale"), "corpus": _corpus_text(data.get("corpus")), "tokenizer": data.get("tokenizer") or {},
        "seeds": seeds, "n_seeds": len(seeds), "regimes": regimes, "sites": data.get("sites") or [],
        "train": data.get("train") or {}, "layers": layers, "feature_groups": groups,
        "settings": _settings(data, seeds), "sign_convention": SIGN, "influence_unit": INFLUENCE_UNIT,
        "ci": "two-sided 95% Student-t interval over seeds; lo/hi are null when n < 2",
        "loss": loss, "probe_quality": probe_quality, "probe_per_feature": per_feature,
        "probe_profiles": profile_rows, "influence": infl, "influence_curves": curve_rows,
        "samples": samples,
    }
    summary["claims"] = [c.to_dict() for c in claims(summary)]
    return summary


# ---------------------------------------------------------------------------------------------------- claims


def _lo(s):
    return (s or {}).get("lo")


def _rule_a() -> Rule:
    def decide(n):
        d, v = n["delta"] or {}, n["vanilla_loss"]
        if d.get("lo") is not None and v is not None and d["lo"] > 0 and d["mean"] >= A_REL * v:
            return REPRODUCED
        return NOT_REPRODUCED if d.get("hi") is not None and d["hi"] < 0 else INCONCLUSIVE

    return Rule("Per seed, Δ = myopic eval loss − vanilla eval loss (same seed, same windows); 95% t-CI over seeds. "
                f"Reproduced if the CI lies above 0 and mean Δ ≥ {A_REL:.0%} of vanilla's mean loss; not reproduced "
                "if the CI lies below 0 (myopic better); otherwise inconclusive.", decide)


def _rule_b() -> Rule:
    def decide(n):
        d, gm, gv = n["D"] or {}, n["gain_myopic"] or {}, n["gain_vanilla"]
        if gv is None or d.get("lo") is None or gm.get("lo") is None:
            return INCONCLUSIVE
        if gm["lo"] > 0 and d["mean"] <= (1 - B_KEEP) * gv:
            return REPRODUCED
        return NOT_REPRODUCED if d["lo"] > B_LOSE * gv else INCONCLUSIVE

    return Rule("Per seed, probe quality q = test Pearson r averaged over the 20 syntactic features, layers 1–L and "
                "probed positions 1–63; gain = q(final) − q(init, same seed); D = q(vanilla) − q(myopic), paired by "
                f"seed. Reproduced if myopic's gain has its CI above 0 and mean D ≤ {1 - B_KEEP:.1f} × vanilla's mean "
                f"gain (myopic keeps ≥ {B_KEEP:.0%} of it); not reproduced if D's CI lower bound > {B_LOSE} × "
                "vanilla's mean gain; otherwise inconclusive.", decide)


def _rule_c() -> Rule:
    def decide(n):
        e, direct = n["E"] or {}, n["direct_share"]
        if e.get("lo") is not None and e["lo"] > 0 and direct is not None and direct > 0:
            return REPRODUCED
        return NOT_REPRODUCED if e.get("hi") is not None and e["hi"] < 0 else INCONCLUSIVE

    return Rule("Vanilla runs; per seed, each component's influence share (component / (|direct| + |pre-cached| + "
                "|shared|) per tracked site × feature) averaged over the 20 syntactic features; E = share(direct) − "
                "share(pre-cached), paired by seed; 95% t-CI. Reproduced if E's CI lies above 0 and the mean direct "
                "share > 0; not reproduced if E's CI lies below 0; otherwise inconclusive. (Direct vs shared is "
                "reported, not scored: the paper compares direct with pre-cached.)", decide)


def claims(summary) -> list[Claim]:
    """The four TinyStories claims of the paper (docs/paper.md#tinystories), judged on ``summary``."""
    lo, pq, infl = summary["loss"], summary["probe_quality"], summary["influence"]
    seeds = (at_least("seeds", summary["n_seeds"], 2),)
    empty = stats([])
    # (a) loss
    d = lo.get("myopic_minus_vanilla") or empty
    van = lo["per_regime"].get("vanilla", {}).get("eval_loss", empty)
    myo = lo["per_regime"].get("myopic", {}).get("eval_loss", empty)
    a_text = f"eval loss (nats/token): vanilla {fmt_ci(van)}, myopic {fmt_ci(myo)}; paired Δ {fmt_ci(d)}"
    # (b) syntax survives
    syn = pq.get("syntax") or {"per_regime": {}}
    v, m = syn["per_regime"].get("vanilla"), syn["per_regime"].get("myopic")
    big_d = syn.get("vanilla_minus_myopic") or empty
    b_text = (f"syntactic probe r: vanilla {fmt_ci(v['final'])}, myopic {fmt_ci(m['final'])}, init "
              f"{fmt_ci(syn.get('init'))}; gain over init: vanilla {fmt_ci(v['gain'])}, myopic {fmt_ci(m['gain'])}; "
              f"D = vanilla − myopic {fmt_ci(big_d)}") if v and m else "no probe data for vanilla and myopic"
    # (c) syntax through the direct path
    sv = infl.get("syntax", {}).get("per_regime", {}).get("vanilla")
    e = sv["direct_minus_pre_cached_share"] if sv else empty
    c_text = ("vanilla influence shares, syntactic features: "
              + "; ".join(f"{COMPONENT_LABELS[c]} {fmt_ci(sv['share'][c])}" for c in COMPONENTS)
              + f"; E = direct − pre-cached {fmt_ci(e)}; direct − shared {fmt_ci(sv['direct_minus_shared_share'])}"
              ) if sv else "no vanilla influence for the syntactic features"
    # (d) position through pre-caching
    pv = infl.get("position", {}).get("per_regime", {}).get("vanilla")
    pos = pq.get("position") or {}
    big_p = pv["pre_cached_minus_direct_share"] if pv else empty
    pos_d = pos.get("vanilla_minus_myopic") or empty
    d_text = ("(d1) vanilla influence shares, position features: "
              + ("; ".join(f"{COMPONENT_LABELS[c]} {fmt_ci(pv['share'][c])}" for c in COMPONENTS) if pv else "n/a")
              + f"; P = pre-cached − direct {fmt_ci(big_p)}. (d2) position probe r: D = vanilla − myopic "
              f"{fmt_ci(pos_d)}")
    return [
        Claim("a", "a myopic model (no pre-caching) reaches a clearly worse held-out loss",
              f"vanilla {PAPER_LOSS['vanilla'][0]} ± {PAPER_LOSS['vanilla'][1]}, myopic {PAPER_LOSS['myopic'][0]} ± "
              f"{PAPER_LOSS['myopic'][1]} nats/token", _rule_a(), {"delta": d, "vanilla_loss": van["mean"]}, a_text,
              seeds),
        Claim("b", "syntactic features (POS tags, dependency labels) survive myopic training",
              "survive (no number given)", _rule_b(),
              {"D": big_d, "gain_myopic": m["gain"] if m else None,
               "gain_vanilla": v["gain"]["mean"] if v else None}, b_text, seeds),
        Claim("c", "syntactic features are learned mainly through the direct path (pre-cached influence ≪ direct)",
              "pre-cached ≪ direct (no number given)", _rule_c(),
              {"E": e, "direct_share": sv["share"]["direct"]["mean"] if sv else None}, c_text, seeds),
        Claim("d", "story-position features come from pre-caching, and their probe quality drops under myopic "
              "training", "high pre-cached influence (one secondary source, low confidence)",
              every(interval_above("P = share(pre-cached) − share(direct) of the position features (vanilla)", "P"),
                    interval_above("D = q(vanilla) − q(myopic) of the position features' probe r", "D")),
              {"P": big_p, "D": pos_d}, d_text, seeds),
    ]


# ---------------------------------------------------------------------------------------------------- figures


def _ci_text(n, capital=False):
    text = f"whiskers: {ci_label(n, 'seeds')}"
    return text[0].upper() + text[1:] if capital else text


def _fig_loss(summary, figdir):
    import matplotlib

    per = summary["loss"]["per_regime"]
    if not per:
        return None
    regimes = [rg for rg in REGIMES if rg in per]
    with matplotlib.rc_context(RC):
        fig, axes = _grid(6.2, 4.2, 1, 1, left=0.8, right=0.2, top=0.62, bottom=0.72, wspace=0.2)
        ax = axes[0][0]
        w = 0.36
        hs = []
        for i, rg in enumerate(regimes):
            s = per[rg]["eval_loss"]
            if s["mean"] is not None:
                hs.append(ax.bar(i - w / 2, s["mean"], w, color=REGIME_COLORS[rg], label="this run (mean ± sd)"))
                if s["sd"] is not None:
                    ax.errorbar([i - w / 2], [s["mean"]], yerr=[s["sd"]], fmt="none", ecolor="#000000", capsize=3)
                xs = [i - w / 2] * len(per[rg]["per_seed"])
                ax.scatter(xs, [r["eval_loss"] for r in per[rg]["per_seed"]], s=10, color="#000000", zorder=3)
                ax.text(i - w / 2, s["mean"] / 2, f"{s['mean']:.2f}", ha="center", color="white", fontsize=9)
            pm, psd = PAPER_LOSS[rg]
            hs.append(ax.bar(i + w / 2, pm, w, color=REGIME_COLORS[rg], alpha=0.35, hatch="//",
                             label="paper (mean ± sd)"))
            ax.errorbar([i + w / 2], [pm], yerr=[psd], fmt="none", ecolor="#000000", capsize=3)
            ax.text(i + w / 2, pm / 2, f"{pm:.2f}", ha="center", fontsize=9,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
        ax.set_xticks(range(len(regimes)), regimes)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(axis="x", visible=False)
        handles = [hs[0], hs[1]] if len(hs) >= 2 else hs
        _finish(fig, "Held-out loss: this run (solid, dots = seeds) vs the paper (hatched)", handles,
                [h.get_label() for h in handles], 2)
        return save_figure(fig, figdir, "loss")


def _fig_probe_groups(summary, figdir):
    import matplotlib

    pq = summary["probe_quality"]
    groups = [g for g in PLOT_GROUPS if g in pq]
    if not groups:
        return None
    series = [("init", "untrained (init)")] + [(rg, rg) for rg in summary["regimes"]]
    with matplotlib.rc_context(RC):
        fig, axes = _grid(7.2, 4.3, 1, 1, left=0.8, right=0.2, top=0.62, bottom=0.8, wspace=0.2)
        ax = axes[0][0]
        w = 0.8 / len(series)
        hs = []
        for j, (key, label) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * w for i in range(len(groups))]
            ss = [pq[g]["init"] if key == "init" else pq[g]["per_regime"][key]["final"] for g in groups]
            hs.append(ax.bar(xs, [s["mean"] or 0.0 for s in ss], w, color=REGIME_COLORS[key], label=label))
            error_bars(ax, xs, ss, bounds=(-1.0, 1.0))
        ax.axhline(0, color="#000000", lw=0.6)
        ax.set_xticks(range(len(groups)), [GROUP_LABELS[g] for g in groups])
        ax.set_ylabel("probe test Pearson r\n(mean over features, layers 1–L, positions 1–63)")
        ax.grid(axis="x", visible=False)
        _finish(fig, f"Probe quality per feature group ({_ci_text(summary['n_seeds'])}, clipped to [−1, 1])", hs,
                [h.get_label() for h in hs], len(hs))
        return save_figure(fig, figdir, "probe_groups")


def _fig_probe_profiles(summary, figdir):
    import matplotlib

    rows = summary["probe_profiles"]
    groups = [g for g in PLOT_GROUPS if any(r["group"] == g for r in rows)]
    layers = summary["layers"]
    if not groups or not layers:
        return None
    with matplotlib.rc_context(RC):
        fig, axes = _grid(2.9 * len(layers) + 1.0, 2.5 * len(groups) + 1.6, len(groups), len(layers), left=0.9,
                          right=0.15, top=0.85, bottom=0.8, wspace=0.15, hspace=0.45, sharex=True)
        for i, g in enumerate(groups):
            for j, k in enumerate(layers):
                ax = axes[i][j]
                if j > 0:
                    ax.sharey(axes[i][0])
                    ax.tick_params(labelleft=False)
                for key in ("init",) + tuple(summary["regimes"]):
                    sel = sorted((r for r in rows if r["group"] == g and r["regime"] == key and r["layer"] == k),
                                 key=lambda r: r["pos"])
                    if not sel:
                        continue
                    xs = [r["pos"] for r in sel]
                    if key != "init":
                        _band(ax, xs, sel, REGIME_COLORS[key], bounds=(-1.0, 1.0))
                    ax.plot(xs, [r["mean"] for r in sel], color=REGIME_COLORS[key], lw=1.0 if key == "init" else 1.5,
                            ls="--" if key == "init" else "-", label="untrained (init)" if key == "init" else key)
                for layer_, pos in summary["sites"]:
                    if layer_ == k:
                        ax.axvline(pos, color="#BBBBBB", lw=0.6, zorder=0)
                ax.set_title(f"{GROUP_LABELS[g]} · layer {k}", fontsize=9)
                if i == len(groups) - 1:
                    ax.set_xlabel("window position")
                if j == 0:
                    ax.set_ylabel("probe r")
        handles, labels = axes[0][0].get_legend_handles_labels()
        _finish(fig, "Probe quality along the window (mean over the group's features)\nbands: "
                f"{ci_label(summary['n_seeds'], 'seeds')}, clipped to [−1, 1]; thin grey lines: tracked sites",
                handles, labels, len(labels))
        return save_figure(fig, figdir, "probe_profiles")


def _fig_influence_shares(summary, figdir):
    import matplotlib

    infl = summary["influence"]
    groups = [g for g in PLOT_GROUPS if g in infl]
    regimes = [rg for rg in summary["regimes"] if any(rg in infl[g]["per_regime"] for g in groups)]
    if not groups or not regimes:
        return None
    with matplotlib.rc_context(RC):
        fig, axes = _grid(4.6 * len(regimes) + 1.0, 4.4, 1, len(regimes), left=0.95, right=0.15, top=0.8,
                          bottom=0.85, wspace=0.3, sharey=True)
        hs = []
        for ax, rg in zip(axes[0], regimes):
            w = 0.8 / len(COMPONENTS)
            for j, c in enumerate(COMPONENTS):
                xs = [i + (j - 1) * w for i in range(len(groups))]
                ss = [infl[g]["per_regime"].get(rg, {}).get("share", {}).get(c) or stats([]) for g in groups]
                h = ax.bar(xs, [s["mean"] or 0.0 for s in ss], w, color=COMPONENT_COLORS[c],
                           label=COMPONENT_LABELS[c])
                if ax is axes[0][0]:
                    hs.append(h)
                error_bars(ax, xs, ss, bounds=(-1.0, 1.0))  # a share lies in [−1, 1]
            ax.axhline(0, color="#000000", lw=0.6)
            ax.set_xticks(range(len(groups)), [GROUP_LABELS[g].split(" (")[0] for g in groups])
            ax.set_title(rg)
            ax.grid(axis="x", visible=False)
        axes[0][0].set_ylabel("influence share\ncomponent / (|direct| + |pre-cached| + |shared|)")
        _finish(fig, f"Integrated Adam influence per component at the tracked sites ({_ci_text(summary['n_seeds'])}, "
                "clipped to [−1, 1])"
                f"\n{SIGN}", hs, [h.get_label() for h in hs], len(hs))
        return save_figure(fig, figdir, "influence_shares")


def _fig_influence_curves(summary, figdir):
    import matplotlib
    from matplotlib.ticker import MaxNLocator

    rows = summary["influence_curves"]
    groups = [g for g in PLOT_GROUPS if any(r["group"] == g for r in rows)]
    regimes = [rg for rg in summary["regimes"] if any(r["regime"] == rg for r in rows)]
    if not groups or not regimes:
        return None
    with matplotlib.rc_context(RC):
        fig, axes = _grid(3.6 * len(regimes) + 1.1, 2.5 * len(groups) + 1.5, len(groups), len(regimes), left=1.1,
                          right=0.15, top=0.85, bottom=0.8, wspace=0.2, hspace=0.45, sharex=True)
        for i, g in enumerate(groups):
            for j, rg in enumerate(regimes):
                ax = axes[i][j]
                if j > 0:
                    ax.sharey(axes[i][0])
                    ax.tick_params(labelleft=False)
                ax.axhline(0, color="#000000", lw=0.6)
                for c in ALL_COMPONENTS:
                    sel = sorted((r for r in rows if r["group"] == g and r["regime"] == rg and r["component"] == c),
                                 key=lambda r: r["step"])
                    if not sel:
                        continue
                    xs = [r["step"] for r in sel]
                    if c != "full":
                        _band(ax, xs, sel, COMPONENT_COLORS[c])
                    ax.plot(xs, [r["mean"] for r in sel], color=COMPONENT_COLORS[c], lw=1.1 if c == "full" else 1.6,
                            ls="--" if c == "full" else "-", label=COMPONENT_LABELS[c])
                ax.set_title(f"{GROUP_LABELS[g]} · {rg}", fontsize=9)
                if i == len(groups) - 1:
                    ax.set_xlabel("training step")
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                if j == 0:
                    ax.set_ylabel("cumulative influence\n(squared probe units;\n+ = toward final value)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        _finish(fig, "Cumulative Adam influence (mean over tracked sites × the group's features; bands: "
                f"{ci_label(summary['n_seeds'], 'seeds')})\n{SIGN}", handles, labels, len(labels))
        return save_figure(fig, figdir, "influence_curves")


def make_figures(summary: dict, figdir: Path) -> dict[str, bytes]:
    """Draw every figure that has data; returns {name: PNG bytes}."""
    return draw_figures(summary, figdir, {"loss": _fig_loss, "probe_groups": _fig_probe_groups,
                                          "probe_profiles": _fig_probe_profiles,
                                          "influence_shares": _fig_influence_shares,
                                          "influence_curves": _fig_influence_curves})


# ---------------------------------------------------------------------------------------------------- document


def _data_note(summary) -> str:
    tok = summary["tokenizer"]
    corpus = _corpus_text(summary["corpus"])
    train = summary["train"]
    if corpus.startswith("generated"):
        what = ("the project's generated story grammar (a stand-in for tests; its text is far simpler than "
                "TinyStories, so nothing here says anything about the paper)")
    elif corpus == "hf" or corpus.startswith("hf:"):
        what = "TinyStoriesV2-GPT4 from the Hugging Face hub, as the paper"
    else:
        n_tr = train.get("n_train")
        tokens = f"about {n_tr * 64 / 1000:.0f}k" if isinstance(n_tr, int) else "far fewer"
        what = (f"a local TinyStories sample ({corpus}; one 64-token window per story "
                f"gives {tokens} training tokens against the paper's 300,000 windows = 19.2M tokens, so the model is "
                "much less trained and sees its windows more than once)")
    tok_text = (f"the hub tokenizer {tok.get('name') or ''}" if tok.get("source") == "hub" else
                f"a byte-level BPE with {tok.get('vocab_size')} tokens trained offline on the training split (the "
                "hub's TinyStories-1M tokenizer, 50,257 ids, was unreachable), so per-token losses are on another "
                "scale than the paper's")
    steps, bs = train.get("steps"), train.get("batch_size")
    seen = f"{steps} steps × {bs} = {steps * bs:,}" if isinstance(steps, int) and isinstance(bs, int) else "?"
    return (f"Data: {what}; {train.get('n_train', '?')} training and {train.get('n_eval', '?')} held-out windows "
            f"of 64 tokens; {seen} windows seen in training (paper: 1000 steps × 256 = 256,000). "
            f"Tokenizer: {tok_text}. Absolute losses are therefore not comparable with the paper; "
            "the vanilla–myopic gap is.")


def _document(summary: dict, figures) -> list[tuple]:
    n = summary["n_seeds"]
    if n >= 2:
        ci_note = "Intervals: two-sided 95% Student-t intervals over seeds (the seed is the unit of replication)."
    elif n == 1:
        ci_note = "Only 1 seed: means only, no intervals; every claim is 'not testable at this scale'."
    else:
        ci_note = "No runs in data.json: nothing to report; every claim is 'not testable at this scale'."
    b = [("h1", "TinyStories: pre-caching, syntax and story position (docs/paper.md#tinystories, claim 4)"),
         ("p", (f"Scale {summary['scale']!s}, {n} seed(s), regimes: {', '.join(summary['regimes']) or 'none'}. "
                f"{ci_note} {SIGN} Layer k = resid[k], the output of block k−1 (after k blocks; 0 = embeddings); "
                "positions are window positions (no BOS; the logits at p predict token p+1). Every number below is "
                "also in summary.json.")),
         ("p", _data_note(summary))]

    b.append(("h2", "Scale and settings"))
    b.append(("p", "This run against the paper's setting; rows marked 'yes' differ from the paper."))
    b.append(("table", ["setting", "this run", "paper", "differs"],
              [[s["setting"], _corpus_text(s["this_run"]) if s["setting"] == "corpus" else s["this_run"], s["paper"],
                "yes" if s["differs"] else ""] for s in summary["settings"]],
              None))

    b.append(("h2", "Claims"))
    b.append(("claims", [c.to_dict() for c in claims(summary)], False))
    b.append(("p", ("Decision rules (fixed before looking at the numbers; the verdicts are whatever the numbers give). "
                   "Influence shares put features of different scales on one footing: per tracked site × feature, "
                   "component / (|direct| + |pre-cached| + |shared|).")))

    b.append(("h2", "Held-out loss"))
    b.append(("fig", "loss",
                  "Held-out (eval-window) loss per regime: bars = mean, whiskers = sd over seeds, dots = seeds; hatched: "
                  "the paper's 2.53 ± 0.10 (vanilla) and 3.29 ± 0.02 (myopic), reported without saying train or eval."))
    lo = summary["loss"]
    rows = []
    for rg, v in lo["per_regime"].items():
        e, t = v["eval_loss"], v["train_loss"]
        rows.append([rg, f"{fmt(e['mean'])} ± {fmt(e['sd'])}", fmt_ci(e), f"{fmt(t['mean'])} ± {fmt(t['sd'])}",
                     f"{PAPER_LOSS[rg][0]:.2f} ± {PAPER_LOSS[rg][1]:.2f}", str(e["n"])])
    if rows:
        b.append(("table", ["regime", "eval loss (mean ± sd)", "eval loss 95% CI", "last train-batch loss (mean ± sd)",
                            "paper (mean ± sd)", "n"], rows, None))
    if lo.get("myopic_minus_vanilla"):
        b.append(("p", (f"Paired myopic − vanilla eval loss: {fmt_ci(lo['myopic_minus_vanilla'])} nats/token "
                       "(paper: +0.76).")))
    _samples_blocks(b, summary)

    b.append(("h2", "Probe quality"))
    b.append(("fig", "probe_groups",
                  "Test Pearson r of ridge probes (fit on the first 70% of the eval windows, tested on the rest), "
                  "averaged over the group's features, layers 1–L and positions 1–63; grey: the untrained model "
                  "(step-0 weights) as the baseline. " + _ci_text(n, capital=True) + "."))
    b.append(("fig", "probe_profiles", "The same along the window, one panel per group and layer."))
    rows = []
    for g in GROUPS:
        e = summary["probe_quality"].get(g)
        if not e:
            continue
        rows.append([GROUP_LABELS[g], fmt_ci(e.get("init")),
                     *(fmt_ci(e["per_regime"][rg]["final"]) if rg in e["per_regime"] else "n/a" for rg in REGIMES),
                     fmt_ci(e.get("vanilla_minus_myopic"))])
    if rows:
        b.append(("table", ["group", "untrained", "vanilla", "myopic", "vanilla − myopic (paired)"], rows, None))
    rows = [[r["feature"], r["group"], fmt(r.get("init", {}).get("mean")),
             *(fmt(r[rg]["mean"]) if rg in r else "n/a" for rg in REGIMES)] for r in summary["probe_per_feature"]]
    if rows:
        b.append(("p", "Per feature (mean over seeds of the mean over layers 1–L and positions 1–63):"))
        b.append(("table", ["feature", "group", "untrained", "vanilla", "myopic"], rows, None))

    b.append(("h2", "Integrated influence"))
    b.append(("fig", "influence_shares",
                  "Integrated Adam influence per component as a share of |direct| + |pre-cached| + |shared| "
                  "per tracked site × feature, averaged over the group (a share lies in [−1, 1]). "
                  + _ci_text(n, capital=True) + f", clipped to [−1, 1]. {SIGN}"))
    b.append(("fig", "influence_curves",
                  "Cumulative influence over training, raw (mean over tracked sites × features of the group; "
                  "position is dominated by pos_int, measured in tokens)."))
    rows = []
    for g in GROUPS:
        e = summary["influence"].get(g)
        if not e:
            continue
        for rg, v in e["per_regime"].items():
            rows.append([GROUP_LABELS[g], rg, *(fmt_ci(v["share"][c]) for c in COMPONENTS),
                         *(fmt_ci(v["raw"][c], fmt_g) for c in ALL_COMPONENTS),
                         fmt_ci(v["raw"]["mismatch_removed"], fmt_g), str(e["n_site_features"])])
    if rows:
        b.append(("p", (f"Shares are dimensionless; raw values in {INFLUENCE_UNIT}, per feature's own units. 'R0 − RT' is "
                       "the mismatch actually removed on held-out windows, which the full influence should roughly "
                       f"match (first order). {SIGN} In a myopic run the pre-cached part is zero by construction "
                       "(other positions' keys and values get no gradient).")))
        b.append(("table", ["group", "regime", "share direct", "share pre-cached", "share shared", "raw direct",
                            "raw pre-cached", "raw shared", "raw full", "R0 − RT", "site × features"], rows, None))
    else:
        b.append(("p", "No influence data."))
    return b


def _samples_blocks(b, summary):
    s = summary.get("samples")
    b.append(("h2", "Sampled continuations"))
    if not s or not s.get("prompts"):
        b.append(("p", "No samples in data.json."))
        return
    spec = s["spec"]
    b.append(("p", (f"The first {spec['prompt_len']} tokens of held-out stories, continued by {spec['n_new']} tokens "
                    f"from each regime's seed-{s['seed_model']} model (temperature {spec['temperature']}, top-k "
                    f"{spec['top_k']}; prompt j draws from torch.Generator seed {spec['seed']} + j, the same for "
                    "both regimes; beyond 64 tokens the context is cropped to the last 64). 'reference' is how the "
                    "story really goes on.")))
    regimes = [rg for rg in REGIMES if rg in s.get("regimes", [])]
    rows = [[p["prompt"], p["reference"], *(p["continuations"].get(rg, "") for rg in regimes)] for p in s["prompts"]]
    b.append(("table", ["prompt", "reference", *regimes], rows, "samples"))


# ---------------------------------------------------------------------------------------------------- entry point


def write_report(out_dir: str | Path) -> Path:
    """Read ``out_dir/data.json``; write figures/, summary.json, report.md and report.html. Returns report.md's path."""
    return write_from_data(out_dir, summarize, make_figures, _document)


def main(argv=None) -> None:
    """Command line: write the report of the folder OUT holding data.json and print the report.md path."""
    report_main("stories_report", "TinyStories", write_report, argv)


if __name__ == "__main__":
    main()
