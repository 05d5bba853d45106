"""Every statistic of the project: Student-t intervals over seeds, Fisher-z intervals of correlations, paired
differences, least-squares slopes, Welch and sigma-ratio intervals, the chi-square interval of a standard deviation,
Spearman's rho, Wilson intervals of proportions and percentile bootstrap intervals. Pure functions of numbers (sequences of floats in, floats and dicts out); scipy (the ``llm``
extra) is imported only by the functions that need its distributions.

A *stats dict* is ``{"mean", "sd", "lo", "hi", "n"}`` (None where undefined), as :func:`stats` makes it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from functools import cache

import numpy as np


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


def mean_of(values) -> float | None:
    """Mean of the finite values; None if there are none."""
    xs = [float(v) for v in values if finite(v)]
    return math.fsum(xs) / len(xs) if xs else None


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


def has_ci(s: dict | None) -> bool:
    """Whether the stats dict ``s`` (see :func:`stats`) has a confidence interval."""
    return s is not None and s["lo"] is not None and s["hi"] is not None


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


def sigma_ci(x: Sequence[float] | np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """Midpoint and half-width of the chi-square ``1 - alpha`` confidence interval for the standard deviation of
    ``x`` (normal model), the paper's ``sigma(ln Q)`` statistic."""
    from scipy import stats as st

    v = np.asarray(x, dtype=float)
    n = v.size
    if n < 2:
        return math.nan, math.nan
    s2, df = v.var(ddof=1), n - 1
    lo = math.sqrt(df * s2 / st.chi2.ppf(1 - alpha / 2, df))
    hi = math.sqrt(df * s2 / st.chi2.ppf(alpha / 2, df))
    return (lo + hi) / 2, (hi - lo) / 2


def spearman(x: Sequence[float], y: Sequence[float]) -> dict:
    """Spearman's rho of the finite pairs with a Fisher-z 95% CI (se ``1.03/sqrt(n-3)``) and the two-sided p of
    scipy; ``{"rho", "lo", "hi", "p", "n"}`` (None where undefined: n < 4 or a constant input)."""
    from scipy import stats as st

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    n = int(a.size)
    out: dict = {"rho": None, "lo": None, "hi": None, "p": None, "n": n}
    if n < 4 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return out
    rho, p = np.asarray(tuple(st.spearmanr(a, b))[:2], dtype=float).tolist()  # (statistic, pvalue) in every scipy
    z, se = math.atanh(max(-0.999999, min(0.999999, rho))), 1.03 / math.sqrt(n - 3)
    out.update(rho=rho, lo=math.tanh(z - 1.96 * se), hi=math.tanh(z + 1.96 * se), p=p)
    return out


def wilson_ci(k: int, n: int) -> dict:
    """The share ``k / n`` with its 95% Wilson score interval: ``{"mean", "lo", "hi", "n"}`` (None with n = 0)."""
    if n <= 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    z, p = 1.959963984540054, k / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (
        1 + z * z / n)
    return {"mean": p, "lo": max(0.0, centre - half), "hi": min(1.0, centre + half), "n": n}


def bootstrap_ci(statistic, sizes: Sequence[int], *, n_boot: int = 2000, seed: int = 0) -> dict:
    """Percentile bootstrap 95% interval of ``statistic(*indices)``: each of the samples (``sizes[i]`` units) is
    resampled with replacement, independently of the others (a paired design is one sample whose indices the
    statistic applies to several arrays). ``{"mean": the statistic on the full samples, "lo", "hi", "n_boot"}``;
    lo and hi None when a sample has fewer than 2 units or the statistic is not finite on 1% of the resamples or
    more (the finite ones are used otherwise). Seeded by ``seed``."""
    full = statistic(*(np.arange(n) for n in sizes))
    out = {"mean": float(full) if finite(full) else None, "lo": None, "hi": None, "n_boot": n_boot}
    if min(sizes, default=0) < 2 or out["mean"] is None:
        return out
    rng = np.random.default_rng(seed)
    draws = np.array([statistic(*(rng.integers(0, n, n) for n in sizes)) for _ in range(n_boot)], dtype=float)
    draws = draws[np.isfinite(draws)]
    if len(draws) >= 0.99 * n_boot:
        out["lo"], out["hi"] = (float(x) for x in np.percentile(draws, [2.5, 97.5]))
    return out
