"""Report of the pretrained-LLM reproduction (docs/paper.md#q, #gemma; claims 5–6 of #claims) from the files of
``ntpflow.experiments.llm.run_llm`` (docs/outputs.md): figures/, summary.json, report.md and report.html.

Statistics: σ(ln Q) as the midpoint ± half-width of its χ² 95% CI (the paper's statistic); formal against other by
the F-distribution 95% CI of σ_formal / σ_other; steering by a Welch 95% CI of the difference of the per-latent mean
code scores; correlations as Spearman's ρ with a Fisher-z 95% CI (se 1.03 / sqrt(n − 3)).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ntpflow.experiments.claim_registry import llm_claims
from ntpflow.experiments.figure_style import (
    BASELINE,
    DOMAIN_COLORS,
    GROUP_COLORS,
    SIGN,
    error_bars,
    figure,
    finish,
    ordered_colors,
)
from ntpflow.experiments.formats import fmt, fmt_interval
from ntpflow.experiments.render import (
    canonical,
    draw_figures,
    report_main,
    stored_summary,
    template_blocks,
    write_documents,
)
from ntpflow.files import json_safe, read_json
from ntpflow.llm.stages import LLMDir
from ntpflow.stats import finite, sd_ratio_ci, sigma_ci, stats, welch_ci

MODES = ("reconstruction", "error-preserving")
DOMAINS = ("stories", "code", "math")
QVI_KEYS = ("spearman", "spearman_share", "spearman_centred", "spearman_share_centred", "spearman_full_horizon",
            "final_layer", "n_layer", "rows", "n_sequences")
LENS_KEYS = ("metrics", "ranks", "primary_rank", "d_model", "n_contexts", "site", "target")
SETUP_KEYS = ("model", "hook", "n_contexts", "ctx_len", "n_train_tokens", "n_eval_tokens")


def _read(out: Path, name: str):
    p = out / name
    return read_json(p) if p.exists() else None


# ------------------------------------------------------------------------------------------------------ statistics


def _q_summary(r: dict) -> dict:
    """ln Q distribution, σ per group, the F ratio, tail make-up and the Fisher tests for one mode."""
    from scipy import stats as st


    inc = [i for i, ok in enumerate(r["included"]) if ok and finite(r["q"][i]) and r["q"][i] > 0]
    lq = np.log(np.asarray([r["q"][i] for i in inc], float))
    formal = np.asarray([bool(r["is_formal"][i]) for i in inc], bool)
    doms = [r["domain"][i] for i in inc]
    out: dict = {"n_scored": len(r["latents"]), "n_included": int(sum(bool(x) for x in r["included"])),
                 "n_positive": len(inc), "lnq": [float(x) for x in lq], "formal": [bool(x) for x in formal],
                 "domain": doms, "kl_cutoff": r.get("kl_cutoff")}
    if len(lq):
        out["lnq_stats"] = {"mean": float(lq.mean()), "sd": float(lq.std(ddof=1)) if len(lq) > 1 else None,
                            "q05": float(np.quantile(lq, 0.05)), "median": float(np.median(lq)),
                            "q95": float(np.quantile(lq, 0.95))}
    for name, m in (("formal", formal), ("other", ~formal)):
        mid, half = sigma_ci(lq[m]) if m.sum() >= 2 else (math.nan, math.nan)
        out[f"sigma_{name}"] = {"sigma": mid, "ci_half": half, "n": int(m.sum())}
    out["sigma_ratio"] = sd_ratio_ci(lq[formal], lq[~formal])
    n = len(lq)
    n_tail = max(1, round(0.1 * n)) if n else 0
    order = np.argsort(lq)
    groups = {"low": order[:n_tail], "high": order[n - n_tail:n], "all": order}
    out["tails"] = {g: {d: (sum(doms[i] == d for i in idx) / len(idx) if len(idx) else None) for d in DOMAINS}
                    for g, idx in groups.items()}
    out["n_tail"] = n_tail
    in_tail = np.isin(np.arange(n), np.concatenate([groups["low"], groups["high"]]))
    a, b = int((in_tail & formal).sum()), int((in_tail & ~formal).sum())
    c, d = int((~in_tail & formal).sum()), int((~in_tail & ~formal).sum())
    fisher = {"tail_formal": a, "tail_other": b, "rest_formal": c, "rest_other": d,
              "tail_share": a / (a + b) if a + b else None, "rest_share": c / (c + d) if c + d else None,
              "p_greater": None, "p_less": None}
    if n >= 4 and (a + b) and (c + d):
        # scipy is unannotated and pyright misreads fisher_exact's result, a (statistic, pvalue) tuple
        for alt in ("greater", "less"):
            pvalue = st.fisher_exact([[a, b], [c, d]], alternative=alt)[1]
            fisher[f"p_{alt}"] = float(pvalue)  # pyright: ignore[reportArgumentType]
    out["tail_test"] = fisher
    return out


def _steer_summary(sj: dict) -> dict:
    out = {"high": sj["high"], "low": sj["low"], "resid_norm": sj["resid_norm"], "runs": []}
    for run in sj["runs"]:
        per = {f: sum(s) / len(s) for f, s in zip(run["latents"], run["score"]) if s}
        hi = [per[f] for f in sj["high"] if f in per]
        lo = [per[f] for f in sj["low"] if f in per]
        examples = {g: [[f, run["texts"][run["latents"].index(f)][0]] for f in sj[g][:3]] for g in ("high", "low")}
        out["runs"].append({"alpha": run["alpha"], "prompts": run["prompts"], "high": stats(hi), "low": stats(lo),
                            "baseline": stats(run["baseline"]), "diff": welch_ci(hi, lo),
                            "examples": {**examples, "baseline": run["baseline_texts"][:1]}})
    return out


def summarize(out: Path) -> dict:
    """Every number of the report and the claims, from the files in ``out`` (no writes)."""
    meta = _read(out, "meta.json") or {}
    quality = _read(out, "quality.json") or {}
    st = _read(out, "stats.json") or {}
    reused = meta.get("reused_stages", ["sae", "scan"] if meta.get("reuse") else [])  # older runs: both
    s: dict = {"scale": meta.get("scale"), "settings": meta.get("settings"), "reuse": meta.get("reuse"),
               "reused_stages": reused, "timing": _read(out, "timing.json")}
    sae = quality.get("sae") or {}
    s["setup"] = {**{k: quality.get(k) for k in SETUP_KEYS},
                  "sae": sae.get("config") or {k: v for k, v in sae.items() if k != "final_losses"}}
    if LLMDir(out).has_contexts():
        domains = LLMDir(out).contexts().domains
        s["setup"]["contexts_per_domain"] = {d: sum(x == d for x in domains) for d in DOMAINS}
    s["sae_quality"] = {"train": quality.get("train"), "eval": quality.get("eval")}
    qsec = quality.get("seconds") or {}
    orig = {"sae": (qsec.get("activations") or 0) + (qsec.get("training") or 0) or None, "scan": st.get("seconds")}
    s["original_seconds"] = {k: v for k, v in orig.items() if k in reused}
    s["q"] = {mode: _q_summary(r) for mode in MODES if (r := _read(out, f"q_{mode}.json")) is not None}
    sj, lj, qj = _read(out, "steering.json"), _read(out, "lens.json"), _read(out, "q_vs_influence.json")
    s["steering"] = _steer_summary(sj) if sj else None
    s["lens"] = ({**{k: lj[k] for k in LENS_KEYS}, "correlation": {m: c["rows"] for m, c in lj["correlation"].items()}}
                 if lj else None)
    s["q_vs_influence"] = ({**{k: qj.get(k) for k in QVI_KEYS}, "n": len(qj["rows"]), "toy_eval": qj.get("eval"),
                            "toy_train": qj.get("train")} if qj else None)
    safe = json_safe(s)
    assert isinstance(safe, dict)  # json_safe keeps a dict a dict
    s = safe
    s["claims"] = [c.to_dict() for c in llm_claims(s)]
    return s


# -------------------------------------------------------------------------------------------------------- figures

Q_NOTE = "Q = Σ KL of later predictions / KL of the next prediction when the latent is ablated (dimensionless, > 0)"


def _fig_hist(s):
    modes = [m for m in MODES if m in s["q"] and s["q"][m]["lnq"]]
    if not modes:
        return None
    fig, axes = figure(4.6 * len(modes) + 0.4, 4.0, 1, len(modes), sharey=True)
    for ax, mode in zip(axes[0], modes):
        q = s["q"][mode]
        lq = q["lnq"]
        lo, hi = min(lq), max(lq)
        bins = [lo + (hi - lo + 1e-9) * i / 20 for i in range(21)]
        for g, flag, ls in (("other", False, "-"), ("formal", True, "--")):
            xs = [x for x, f in zip(lq, q["formal"]) if f == flag]
            sg = q[f"sigma_{g}"]
            ax.hist(xs, bins=bins, histtype="step", lw=2.0, ls=ls, color=GROUP_COLORS[g],
                    label=f"{g} latents (σ of ln Q: {fmt(sg['sigma'], 2)} ± {fmt(sg['ci_half'], 2)}, 95% χ²-CI)"
                    if len(modes) == 1 else f"{g} latents")
        ax.set_title(f"{mode} ablation (n = {len(lq)} included latents with Q > 0)")
        ax.set_xlabel("ln Q")
    axes[0][0].set_ylabel("latents per bin")
    finish(fig, "ln Q of SAE latents: formal (code + math hold > half of the top examples) vs other\n" + Q_NOTE,
           ncol=2)
    return fig


def _fig_tails(s):
    modes = [m for m in MODES if m in s["q"] and s["q"][m]["lnq"]]
    if not modes:
        return None
    fig, axes = figure(3.8 * len(modes) + 0.6, 3.8, 1, len(modes), sharey=True)
    for ax, mode in zip(axes[0], modes):
        t, n_tail, n = s["q"][mode]["tails"], s["q"][mode]["n_tail"], len(s["q"][mode]["lnq"])
        bottom = [0.0] * 3
        for d in DOMAINS:
            vals = [t[g][d] or 0.0 for g in ("low", "all", "high")]
            ax.bar(range(3), vals, bottom=bottom, color=DOMAIN_COLORS[d], label=d, width=0.6,
                   edgecolor="white")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(3), [f"lowest 10%\n(n = {n_tail})", f"all\n(n = {n})", f"highest 10%\n(n = {n_tail})"])
        ax.set_ylim(0, 1)
        ax.grid(axis="x", visible=False)
        ax.set_title(f"{mode} ablation")
    axes[0][0].set_ylabel("share of latents by domain")
    finish(fig, "Domain of a latent's top-activating contexts, in the tails of ln Q and overall", ncol=3)
    return fig


def _fig_steering(s):
    st = s.get("steering")
    if not st or not st["runs"]:
        return None
    labels = {"high": "high-Q latents", "low": "low-Q latents", "baseline": "no steering"}
    fig, axes = figure(2.9 * len(st["runs"]) + 0.8, 3.9, 1, len(st["runs"]), sharey=True)
    for ax, run in zip(axes[0], st["runs"]):
        for i, g in enumerate(("high", "low", "baseline")):
            r = run[g]
            if r["mean"] is None:
                continue
            ax.bar(i, r["mean"], color=GROUP_COLORS[g], width=0.6, label=labels[g])
            error_bars(ax, [i], [r], bounds=(0.0, 1.0))
            ax.annotate(f"{r['mean']:.2f}\nn={r['n']}", (i, r["hi"] if r["hi"] is not None else r["mean"]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
        ax.set_xticks(range(3), ["high Q", "low Q", "none"])
        ax.grid(axis="x", visible=False)
        ax.set_title(f"strength alpha = {run['alpha']}")
    axes[0][0].set_ylabel("code score (share of code-like characters)")
    finish(fig, "Steered continuations: mean code score, whiskers 95% t-CI (over latents; 'no steering': over "
           "prompts), clipped to [0, 1]", ncol=3)
    return fig


def _fig_lens(s):
    ln = s.get("lens")
    if not ln:
        return None
    fig, axes = figure(10.0, 4.2, 1, 2)
    ax = axes[0][0]
    ks = [m["k"] for m in ln["metrics"]]
    ax.plot(ks, [m["top1"] for m in ln["metrics"]], "o-", color="#000000", label="lens top-1 (token t+k)")
    ax.plot(ks, [m["model_top1"] for m in ln["metrics"]], "s--", color=BASELINE,
            label="model's own top-1 at t+k−1 (reference)")
    ax.plot(ks, [m["agree"] for m in ln["metrics"]], "^:", color="#000000", label="lens agrees with model")
    ax.set_xticks(ks)
    ax.set_ylim(0, 1)
    ax.set_xlabel("look-ahead offset k (tokens)")
    ax.set_ylabel("top-1 accuracy (held-out contexts)")
    ax.set_title(f"look-ahead lenses (n = {ln['n_contexts']} contexts, 20% held out)")
    ax = axes[0][1]
    rows = ln["correlation"].get("reconstruction", [])
    colors = ordered_colors(len(ln["ranks"]), "cividis")  # ranks are ordered
    n = None
    for i, r in enumerate(ln["ranks"]):
        rr = [x for x in rows if x["r"] == r and x["rho"] is not None]
        if not rr:
            continue
        n = rr[0]["n"]
        xs = [x["k"] + 0.1 * (i - 1) for x in rr]
        ax.errorbar(xs, [x["rho"] for x in rr], yerr=[[x["rho"] - x["lo"] for x in rr],
                                                      [x["hi"] - x["rho"] for x in rr]],
                    fmt="o", color=colors[i], capsize=2, label=f"projector rank {r} of {ln['d_model']}")
    ax.axhline(0, color="#333333", lw=0.8)
    ax.set_xticks(ks)
    ax.set_ylim(-1, 1)
    ax.set_xlabel("look-ahead offset k (tokens)")
    ax.set_ylabel("Spearman ρ(Q, overlap), Fisher-z 95% CI")
    ax.set_title(f"Q vs lens overlap (reconstruction ablation, n = {n} latents)")
    finish(fig, "Look-ahead lens: accuracy, and the rank correlation of Q with a latent's overlap with the lens's "
           "top singular directions", ncol=3)
    return fig


def _fig_qvi(s):
    qv = s.get("q_vs_influence")
    if not qv or not qv["rows"]:
        return None
    cut = qv.get("n_layer")
    pts = [r for r in qv["rows"] if (cut is None or r["layer"] < cut) and r["q"] is not None and r["q"] > 0
           and r["share"] is not None]
    fig, axes = figure(5.6, 4.6)
    ax = axes[0][0]
    layers = sorted({r["layer"] for r in pts})
    for layer, color in zip(layers, ordered_colors(len(layers))):  # layers: the sequential map of every report
        sel = [r for r in pts if r["layer"] == layer]
        ax.scatter([math.log(r["q"]) for r in sel], [r["share"] for r in sel], s=14,
                   color=color, label=f"probe sites at layer {layer}")
    ax.axhline(0, color="#333333", lw=0.6)
    ax.set_xlabel("ln Q (ablation of the probe direction)")
    ax.set_ylabel("I_pre-cached / (|I_pre-cached| + |I_direct|)")
    sp = qv["spearman"]
    ax.set_title(f"ρ(Q, I_pre/I_direct) = {fmt_interval(sp, 'rho')}, "
                 f"n = {sp['n']} sites (layer < {cut}); {len(pts)} shown", fontsize=9)
    finish(fig, f"Toy run: Q by ablation vs the replay's integrated influence\n{SIGN}", ncol=2)
    return fig


FIGURES = {"lnq_hist": _fig_hist, "q_tails": _fig_tails, "steering": _fig_steering, "lens": _fig_lens,
           "q_vs_influence": _fig_qvi}


# --------------------------------------------------------------------------------------------------------- document


def _document(s: dict, figures) -> list[tuple]:
    return template_blocks("llm", [c.to_dict() for c in llm_claims(s)], s=s, domains=DOMAINS)


def write_report(out: str | Path) -> Path:
    """Write report.md, report.html, summary.json and figures into ``out``; returns ``out/report.html``."""
    out = Path(out)
    if (out / "quality.json").exists():
        s = canonical(summarize(out))
    elif (out / "summary.json").exists():  # re-render the stored numbers (the committed docs/results)
        s = stored_summary(out)
    else:
        raise FileNotFoundError(f"no llm results in {out} (missing quality.json); run run_llm first")
    pngs = draw_figures(s, out / "figures", FIGURES)
    write_documents(out, _document(s, pngs), pngs, s)
    return out / "report.html"


if __name__ == "__main__":
    report_main("llm_report", "pretrained-LLM", write_report)
