"""The answer of an attribution as a reader wants it: per site and feature, each component's share of the change, the
residual, how well-posed the split is, and whether the feature is NTP-useful there.

A share is the component's integrated influence (the run's own reading: ``adam``, ``momentum`` or plain ``sgd``)
divided by the change it splits: the exact change Σ_t R_H(θ_t) − R_H(θ_t+1) with the exact account, else the mismatch
removed on held-out data (the paper's readings, which add up to it to first order only). Shares add up to 1 (the
exact account, up to the residual). ``useful``: the task's ``useful[pos, feature]`` (NTP-useful: the feature helps
predict the next token there), None for a direction of one's own.
"""

import math

import numpy as np

from ntpflow.replay.conditioning import parts_of

LABELS = {"direct": "direct", "pre_cached": "pre-cached", "shared": "shared", "decay": "decay"}
MISMATCH_LABELS = {"centred": "R_c", "paper": "R"}


def useful_flag(task, pos: int, feature: str) -> bool | None:
    """Whether ``feature`` is NTP-useful at position ``pos`` of ``task`` (None: not one of the task's features)."""
    names = list(task.feature_names)
    if feature not in names or getattr(task, "useful", None) is None:
        return None
    return bool(np.asarray(task.useful)[pos, names.index(feature)])


def shares(entry: dict, own: str) -> dict[str, float] | None:
    """Each component's share of the change an attribution summary entry splits (module docstring); None when that
    change is 0 or the entry lacks the reading."""
    change = entry.get("change", entry.get("R0_minus_RT_eval"))
    if not change or f"{own}_full" not in entry:
        return None
    return {c: entry[f"{own}_{c}"] / change for c in parts_of(entry, own)}


def answer_lines(summary: list[dict], own: str, limit: int = 40) -> list[str]:
    """One line per site × feature (the centred mismatch R_c first, then R): the change, each component's share, κ
    and the residual, with the NTP-useful / useless mark; at most ``limit`` lines, then how many more."""
    order = {"centred": 0, "paper": 1}
    rows = sorted(summary, key=lambda e: (e["layer"], e["pos"], e["feature"], order.get(e["mismatch"], 2)))
    lines = []
    for e in rows:
        sh = shares(e, own)
        if sh is None:
            continue
        mark = {True: "NTP-useful", False: "NTP-useless", None: "your direction"}[e.get("useful")]
        kappa = e.get(f"kappa_{own}")
        extra = [f"κ {kappa:.3g}"] if kappa is not None and math.isfinite(kappa) else []
        if e.get("residual") is not None and e.get("R0_eval"):
            extra.append(f"residual {abs(e['residual']) / e['R0_eval']:.1e} of R_H(θ₀)")
        change = e.get("change", e.get("R0_minus_RT_eval"))
        lines.append(f"⟨{e['layer']}, {e['pos']}⟩ {e['feature']} ({mark}), {MISMATCH_LABELS.get(e['mismatch'], e['mismatch'])}"
                     f" change {change:.3g} = " + " + ".join(f"{LABELS[c]} {sh[c]:.2f}" for c in sh)
                     + (f" ({'; '.join(extra)})" if extra else ""))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more in summary.json"]
    return lines
