"""Number formats and table helpers of the experiment reports: stats dicts as text, the rows of the settings and
mismatch tables, row selection.

The statistics live in ``ntpflow.stats``, the figure style in ``figure_style``, the renderer (templates ->
md/html/json) in ``render`` and every claim with its rule in ``claim_registry``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ntpflow.runs.config import TrainConfig
from ntpflow.stats import has_ci, mean_of

COMPONENTS = ("direct", "pre_cached", "shared")
MISMATCHES = ("centred", "paper")  # R_c = var_b d_b and the paper's R = mean_b d_b² (docs/experiments/toy.md)
COMPONENT_LABELS = {"direct": "direct", "pre_cached": "pre-cached", "shared": "shared", "full": "full (= sum)"}
TRAIN_KEYS = ("steps", "batch_size", "lr", "n_layer", "d_model", "n_head", "n_train", "n_eval")


def reading_rows(influence: Path, own: str) -> list[dict]:
    """The whole-batch rows (feature type −1) of an attribution's ``influence.parquet`` that a report reads: the run's
    own split ``own`` (``TrainConfig.own_rows``) and the SGD direction ("sgd") where the replay kept it; columns step,
    layer, pos, feature, mismatch, component, optimizer, cumulative."""
    table = pq.read_table(influence)
    # pyarrow.compute functions are generated at import; not in the stubs
    table = table.filter(pc.and_(  # pyright: ignore[reportAttributeAccessIssue]
        pc.is_in(table["optimizer"], pa.array([own, "sgd"])),  # pyright: ignore[reportAttributeAccessIssue]
        pc.equal(table["feature_type"], -1)))  # pyright: ignore[reportAttributeAccessIssue]
    return table.select(["step", "layer", "pos", "feature", "mismatch", "component", "optimizer",
                         "cumulative"]).to_pylist()


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
    """The setting row "influence read" (none when no replay recorded it: before the record, or no replays)."""
    at = data.get("influence_read_at")
    text = {"start": "on each step's batch, ∇R at its start θ_t (the paper's reading)",
            "midpoint": "on each step's batch, ∇R at its midpoint",
            "exact": "the exact account: a fixed readout set, each step's change split by a path integral"}
    return [{"setting": "influence read", "this_run": text[at], "paper": text["start"]}] if at else []


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


def curve_steps(steps: Iterable[int], stride: int) -> set[int]:
    """The steps of an influence curve, of ``steps`` (those of the rows): a replay has a row for every step, so every
    ``stride``-th and the last; a run's account has one per chunk of steps (its last), so all of them."""
    steps = sorted(set(steps))
    if len(steps) < steps[-1] - steps[0] + 1:  # rows per chunk
        return set(steps)
    return {s for s in steps if s % stride == 0} | {steps[-1]}
