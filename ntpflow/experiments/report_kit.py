"""Shared pieces of the experiment reports: statistics, number formatting, tables and the report pipeline.

The figure style lives in ``figure_style``, the renderer (templates -> md/html/json) in ``render`` and every claim
with its rule in ``claim_registry``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cache

from ntpflow.runs.config import TrainConfig

COMPONENTS = ("direct", "pre_cached", "shared")
MISMATCHES = ("centred", "paper")  # R_c = var_b d_b and the paper's R = mean_b d_b² (docs/experiments/toy.md)
COMPONENT_LABELS = {"direct": "direct", "pre_cached": "pre-cached", "shared": "shared", "full": "full (= sum)"}
TRAIN_KEYS = ("steps", "batch_size", "lr", "n_layer", "d_model", "n_head", "n_train", "n_eval")


def _t_central(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer ``df`` (closed-form finite series)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        acc, term = 0.0, math.cos(theta)
        if df > 1:
            acc = term
            for k in range(3, df - 1, 2):  # terms cos^k θ · (2·4···(k−1)) / (1·3···k)
                term *= c2 * (k - 1) / k
                acc += term
        return 2.0 / math.pi * (theta + s * acc) if df > 1 else 2.0 * theta / math.pi
    acc, term = 1.0, 1.0
    for k in range(2, df - 1, 2):  # terms cos^k θ · (1·3···(k−1)) / (2·4···k)
        term *= c2 * (k - 1) / k
        acc += term
    return s * acc


@cache
def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` ≥ 1 degrees of freedom (bisection, deterministic)."""
    if df < 1:
        raise ValueError(f"df must be ≥ 1, got {df}")
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_central(mid, df) < 0.95:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def finite(x) -> bool:
    """Whether ``x`` is a finite int or float (not None, NaN or ±inf)."""
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def finite_or_none(x):
    """``x`` if it is a finite number, else None (for JSON: NaN and ±inf become null)."""
    return x if finite(x) else None


def stats(values) -> dict:
    """Mean, sd, 95% t-interval (lo, hi) and n of the finite values; None where undefined."""
    xs = [float(v) for v in values if finite(v)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "sd": None, "lo": None, "hi": None, "n": 0}
    mean = math.fsum(xs) / n
    if n == 1:
        return {"mean": mean, "sd": None, "lo": None, "hi": None, "n": 1}
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    h = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "lo": mean - h, "hi": mean + h, "n": n}


def r_stats(values) -> dict:
    """Mean and 95% interval of Pearson r values, computed in Fisher z (atanh) and transformed back."""
    vals = [max(-0.999999, min(0.999999, v)) for v in values if v is not None and math.isfinite(v)]
    z = stats(math.atanh(v) for v in vals)  # sd stays in z units
    return {**z, **{k: (None if z[k] is None else math.tanh(z[k])) for k in ("mean", "lo", "hi")}}


def stat_rows(records, keys: tuple[str, ...], value: str) -> list[dict]:
    """One row per distinct ``keys`` of ``records`` (sorted by them): the keys and the ``stats`` of the ``value``s."""
    groups = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in keys)].append(r[value])
    return [{**dict(zip(keys, k)), **stats(v)} for k, v in sorted(groups.items())]


def mismatch_summary(paper: list[dict], centred: list[dict] | None, records: list[dict], keys: tuple[str, ...]) -> dict:
    """R_c beside R: ``{"mismatch_by_site": rows, "centred_recorded": whether there are centred rows}``. One row per
    distinct ``keys`` of the influence rows of each mismatch (``paper``, ``centred``: with ``component`` and
    ``total``) and of ``records`` (per mismatch: ``R0_minus_RT_eval``, ``offset_share_R0``; docs/outputs.md), sorted
    by them: the keys and the means over the group's rows of ``{mismatch}_{component}`` (direct, pre_cached, shared,
    full), ``{mismatch}_removed`` (held-out R(θ_0) − R(θ_T)) and ``offset_share`` (of R at step 0, from the paper's
    records); None where the group has no finite value."""
    cell = defaultdict(list)
    for m, rows in (("paper", paper), ("centred", centred or [])):
        for r in rows:
            if r["component"] in (*COMPONENTS, "full"):
                cell[tuple(r[k] for k in keys), f"{m}_{r['component']}"].append(r["total"])
    for r in records:
        key = tuple(r[k] for k in keys)
        cell[key, f"{r['mismatch']}_removed"].append(r["R0_minus_RT_eval"])
        if r["mismatch"] == "paper":
            cell[key, "offset_share"].append(r.get("offset_share_R0"))
    columns = [f"{m}_{c}" for m in MISMATCHES for c in (*COMPONENTS, "full", "removed")] + ["offset_share"]
    return {"mismatch_by_site": [{**dict(zip(keys, key)), **{c: mean_of(cell.get((key, c), ())) for c in columns}}
                                 for key in sorted({key for key, _ in cell})], "centred_recorded": bool(centred)}


def paired(a: dict, b: dict) -> dict:
    """Stats of a[s] − b[s] over the keys (seeds) with a finite value in both."""
    return stats(a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None)


def slope(xs, ys) -> float | None:
    """Least-squares slope of the finite (x, y) pairs; None with fewer than 2 distinct x."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if finite(y)]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def sd_ratio_ci(a, b) -> dict:
    """σ_a/σ_b of two samples with the F-distribution 95% CI (normal model): ``{ratio, lo, hi, n_a, n_b}``; None
    with fewer than 3 values in either."""
    import numpy as np
    from scipy import stats as st

    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.size < 3 or b.size < 3:
        return {"ratio": None, "lo": None, "hi": None, "n_a": int(a.size), "n_b": int(b.size)}
    f = a.var(ddof=1) / max(b.var(ddof=1), 1e-300)
    d1, d2 = a.size - 1, b.size - 1
    lo = f / st.f.ppf(0.975, d1, d2)
    hi = f / st.f.ppf(0.025, d1, d2)
    return {"ratio": math.sqrt(f), "lo": math.sqrt(lo), "hi": math.sqrt(hi), "n_a": int(a.size), "n_b": int(b.size)}


def welch_ci(a, b) -> dict:
    """mean(a) − mean(b) of the finite values with a Welch 95% CI and two-sided p: ``{diff, lo, hi, p, n_a, n_b}``
    (lo/hi/p None with fewer than 2 values in either)."""
    import numpy as np
    from scipy import stats as st

    a, b = np.asarray([x for x in a if finite(x)], float), np.asarray([x for x in b if finite(x)], float)
    out = {"diff": None, "lo": None, "hi": None, "p": None, "n_a": int(a.size), "n_b": int(b.size)}
    if a.size < 2 or b.size < 2:
        if a.size and b.size:
            out["diff"] = float(a.mean() - b.mean())
        return out
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    diff = float(a.mean() - b.mean())
    se = math.sqrt(va + vb)
    if se == 0:
        return {**out, "diff": diff, "lo": diff, "hi": diff, "p": None}
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    t = st.t.ppf(0.975, df)
    p = 2 * st.t.sf(abs(diff / se), df)
    return {**out, "diff": diff, "lo": diff - t * se, "hi": diff + t * se, "p": float(p), "df": float(df)}


def mean_of(values) -> float | None:
    """Mean of the finite values; None if there are none."""
    xs = [float(v) for v in values if finite(v)]
    return math.fsum(xs) / len(xs) if xs else None


def has_ci(s: dict | None) -> bool:
    """Whether the stats dict ``s`` (see :func:`stats`) has a confidence interval."""
    return s is not None and s["lo"] is not None and s["hi"] is not None


def fmt(x, digits=3) -> str:
    """``x`` with ``digits`` decimals, or "n/a" for None."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def fmt_g(x) -> str:
    """``x`` to 3 significant digits, or "n/a" for None."""
    return "n/a" if x is None else f"{x:.3g}"


def fmt_ci(s: dict | None, fmt=fmt) -> str:
    """A stats dict as "mean [lo, hi]", "mean (n=N)" without an interval, or "n/a"; numbers through ``fmt``."""
    if s is None or s["mean"] is None:
        return "n/a"
    if has_ci(s):
        return f"{fmt(s['mean'])} [{fmt(s['lo'])}, {fmt(s['hi'])}]"
    return f"{fmt(s['mean'])} (n={s['n']})"


def fmt_interval(x: dict | None, key: str, digits: int = 2) -> str:
    """``x[key]`` and its interval as "value [lo, hi]" ("n/a" for what is missing)."""
    x = x or {}
    return f"{fmt(x.get(key), digits)} [{fmt(x.get('lo'), digits)}, {fmt(x.get('hi'), digits)}]"


def fmt_sigma(x: dict | None) -> str:
    """A σ(ln Q) dict {sigma, ci_half, n} as "σ ± half-width (n=N)"."""
    x = x or {}
    return f"{fmt(x.get('sigma'), 2)} ± {fmt(x.get('ci_half'), 2)} (n={x.get('n')})"


def select(rows, order: str | None = None, **where) -> list[dict]:
    """The rows whose keys equal ``where``, sorted by the key ``order`` (in their order without one)."""
    sel = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    return sorted(sel, key=lambda r: r[order]) if order else sel


def plain_number(v) -> str:
    """A setting for a table: whole floats >= 1 without ``.0``, anything else as ``str``."""
    if isinstance(v, float) and v == int(v) and abs(v) >= 1:
        return str(int(v))
    return str(v)


def read_at_settings(data: dict) -> list[dict]:
    """The setting row "∇R of an influence read at" (none when no replay recorded it: before the record, or no
    replays)."""
    at = data.get("influence_read_at")
    text = {"start": "each step's start θ_t", "midpoint": "each step's midpoint (docs/balance.md)"}
    return [{"setting": "∇R of an influence read at", "this_run": text[at], "paper": text["start"]}] if at else []


def train_settings(train: dict, paper: dict) -> list[dict]:
    """Setting rows {setting, this_run, paper} of the training settings (:data:`TRAIN_KEYS`): this run's value
    (TrainConfig's default where ``train`` lacks it) and the ``paper``'s."""
    defaults = TrainConfig().to_dict()
    return [{"setting": k, "this_run": plain_number(train.get(k, defaults[k])), "paper": paper[k]} for k in TRAIN_KEYS]


def sites_text(sites) -> str:
    """``[[layer, pos], ...]`` -> ``"layer 1 × positions 4, 8; layer 2 × positions 4"`` (``"none"`` if empty)."""
    by_layer: dict = {}
    for layer, pos in sites:
        by_layer.setdefault(layer, []).append(pos)
    if not by_layer:
        return "none"
    return "; ".join(f"layer {k} × positions {', '.join(str(p) for p in sorted(v))}"
                     for k, v in sorted(by_layer.items()))


