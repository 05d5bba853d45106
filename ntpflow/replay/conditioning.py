"""How well-posed a split of the training steps into the three components is (docs/balance.md#conditioning).

The components of a row add up to its full influence, I_direct + I_pre_cached + I_shared = I_full, but they may do
so by cancelling. The row's conditioning number

    κ = (|I_direct| + |I_pre_cached| + |I_shared|) / |I_full|  ≥ 1

says how much: at κ = 1 no component works against the net change; in general the components that do sum to
(κ − 1)/2 of it. Its step-level form, κ_steps = Σ_t Σ_c |I_c,t| / Σ_t |I_full,t|, counts the cancellation within
each step, not only over the run. Both are computed for each reading a replay writes: the optimizer's own split
(``adam``, or ``momentum`` for SGD with momentum), where every component is multiplied by the full gradient's step
scale, and the SGD direction (``sgd``, lr · g_c along the same path). Where the two readings give a component
opposite signs, the optimizer's scale, not the gradient paths, decided its sign.
"""

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

PARTS = ("direct", "pre_cached", "shared")
ROW = ("layer", "pos", "feature", "feature_type", "mismatch", "optimizer")  # one row of influence.parquet's totals


def kappa(parts: Sequence[float], full: float) -> float | None:
    """Σ_c |parts_c| / |full|; None when ``full`` is 0 (nothing to split)."""
    return sum(abs(p) for p in parts) / abs(full) if full else None


def step_kappas(table: pa.Table) -> dict[tuple, float | None]:
    """κ_steps of every row of an influence table (its per-step ``value`` column): {ROW key: Σ_t Σ_c |I_c,t| /
    Σ_t |I_full,t|}, None where every step's full influence is 0. Summed in the table's order (``np.bincount``), so
    the same table gives the same bits whatever the thread count."""
    table = table.select([*ROW, "component", "value"])
    comp = np.asarray(table["component"].to_pylist(), dtype=object)
    keep = np.isin(comp, [*PARTS, "decay", "full"])  # decay: AdamW's own row (ntpflow.engine.exact)
    cols = [table[k].to_pylist() for k in ROW]
    keys = [tuple(c[j] for c in cols) for j in np.flatnonzero(keep)]
    index: dict[tuple, int] = {}
    ids = np.fromiter((index.setdefault(k, len(index)) for k in keys), dtype=np.int64, count=len(keys))
    absval = np.abs(table["value"].to_numpy(zero_copy_only=False)[keep])
    is_full = comp[keep] == "full"
    parts = np.bincount(ids[~is_full], absval[~is_full], minlength=len(index))
    full = np.bincount(ids[is_full], absval[is_full], minlength=len(index))
    return {k: (float(parts[i] / full[i]) if full[i] else None) for k, i in index.items()}


def readings(entry: dict) -> list[str]:
    """The readings whose totals a summary entry holds (``{optimizer}_{component}`` keys), in a fixed order."""
    return [o for o in ("adam", "adamw", "momentum", "sgd") if f"{o}_full" in entry]


def condition(entry: dict, steps: dict[tuple, float | None], key: tuple, own: str) -> dict:
    """The conditioning of one summary entry (totals ``{optimizer}_{component}``): ``kappa_{o}`` and
    ``kappa_steps_{o}`` for each reading o, and where the run's own reading ``own`` and the SGD direction are both
    there, ``signs_agree`` {component: whether they have the same sign (two exact zeros agree)}. ``key``: the
    entry's (layer, pos, feature, feature_type, mismatch), to look up ``steps`` (:func:`step_kappas`)."""
    out: dict = {}
    for o in readings(entry):
        out[f"kappa_{o}"] = kappa([entry[f"{o}_{c}"] for c in parts_of(entry, o)], entry[f"{o}_full"])
        out[f"kappa_steps_{o}"] = steps.get((*key, o))
    if own != "sgd" and {own, "sgd"} <= set(readings(entry)):
        out["signs_agree"] = {c: _sign(entry[f"{own}_{c}"]) == _sign(entry[f"sgd_{c}"]) for c in PARTS}
    return out


def parts_of(entry: dict, reading: str) -> tuple[str, ...]:
    """The parts a summary entry splits ``reading``'s full influence into: PARTS, and ``decay`` where the reading has
    it (AdamW's weight decay, its own row so that the parts still add up to the step)."""
    return PARTS + (("decay",) if f"{reading}_decay" in entry else ())


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def conditioning_lines(summary: list[dict], own: str) -> list[str]:
    """One line per mismatch: each reading's κ (median and largest over the rows, from the totals and the steps) and
    how many components of how many the two readings give the same sign."""
    lines = []
    for mismatch in ("paper", "centred"):
        rows = [e for e in summary if e["mismatch"] == mismatch]
        parts = []
        for o in dict.fromkeys(o for e in rows for o in readings(e)):
            for what, key in (("κ", f"kappa_{o}"), ("κ_steps", f"kappa_steps_{o}")):
                values = sorted(e[key] for e in rows if e.get(key) is not None)
                if values:
                    parts.append(f"{what} ({o}) median {values[len(values) // 2]:.3g}, largest {values[-1]:.3g}")
        agree = [v for e in rows for v in (e.get("signs_agree") or {}).values()]
        if agree:
            parts.append(f"{own} and sgd agree in sign on {sum(agree)}/{len(agree)} components")
        if parts:
            lines.append(f"conditioning, {mismatch}: " + "; ".join(parts))
    return lines
