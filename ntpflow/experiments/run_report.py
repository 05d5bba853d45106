"""A report of one attribution, any run's (your own task included): ``ntpflow report RUN|ATTRIBUTION``.

Reads an attribution folder (``summary.json``, ``influence.parquet``) and writes, into ``ATTRIBUTION/report/``, the
influence bars (each component's share of the change, NTP-useful and NTP-useless sites apart) and the cumulative
influence curves (the same two groups), a table of every row's split (the answer ``attribute`` prints), and
``report.md``, a self-contained ``report.html`` and ``summary.json`` (``render.write_documents``).

:class:`Attribution` is the same in Python: what ``ntpflow.attribute`` returns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ntpflow.files import read_json
from ntpflow.model.sites import Site
from ntpflow.replay.answer import LABELS, MISMATCH_LABELS, answer_lines, shares
from ntpflow.replay.attribution import attribute as replay_attribute
from ntpflow.replay.conditioning import PARTS
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.run import AttributionDir, RunPaths

GROUPS = {True: "NTP-useful", False: "NTP-useless", None: "your directions"}


class Attribution(os.PathLike):
    """A finished attribution folder as results: ``summary`` (summary.json), ``table`` (influence.parquet as a pyarrow
    Table), ``rows`` (the same as a pandas DataFrame, if pandas is installed), ``shares()``, ``lines()`` (the answer
    ``attribute`` prints), ``plot()`` and ``report()``. It is also the folder's path (``os.PathLike``, ``/``)."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not AttributionDir(self.dir).done:
            raise ValueError(f"{self.dir} holds no finished attribution (ntpflow attribute writes one)")

    def __fspath__(self) -> str:
        return str(self.dir)

    def __truediv__(self, other) -> Path:
        return self.dir / other

    def __str__(self) -> str:
        return str(self.dir)

    def __repr__(self) -> str:
        return f"Attribution({str(self.dir)!r})"

    def __eq__(self, other) -> bool:
        return Path(self) == Path(other) if isinstance(other, str | os.PathLike) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.dir)

    def exists(self) -> bool:
        return self.dir.exists()

    @property
    def summary(self) -> dict:
        """summary.json: per probe and mismatch the totals of each reading, κ, shares, the NTP-useful flag."""
        return read_json(AttributionDir(self.dir).summary)

    @property
    def own(self) -> str:
        """The run's own reading ("adam", "momentum" or "sgd")."""
        return self.summary.get("own_rows", "adam")

    @property
    def table(self):
        """influence.parquet as a pyarrow Table: one row per step, site, feature, type, mismatch, component, reading."""
        return pq.read_table(AttributionDir(self.dir).influence)

    @property
    def rows(self):
        """influence.parquet as a pandas DataFrame (needs pandas; ``table`` needs nothing more)."""
        try:
            import pandas  # noqa: F401
        except ImportError:
            raise ImportError("Attribution.rows needs pandas (pip install pandas); Attribution.table is the same "
                              "rows as a pyarrow Table") from None
        return self.table.to_pandas()

    def shares(self, mismatch: str = "centred") -> list[dict]:
        """Per site × feature: {layer, pos, feature, useful, change, direct, pre_cached, shared} — each component's
        share of the change in the run's own reading (``mismatch``: "centred" R_c, or "paper" R)."""
        own, out = self.own, []
        for e in self.summary["probes"]:
            sh = shares(e, own)
            if e["mismatch"] == mismatch and sh is not None:
                out.append({"layer": e["layer"], "pos": e["pos"], "feature": e["feature"],
                            "useful": e.get("useful"), "change": e.get("change", e.get("R0_minus_RT_eval")), **sh})
        return out

    def lines(self) -> list[str]:
        """The answer ``ntpflow attribute`` prints (``replay.answer.answer_lines``)."""
        return answer_lines(self.summary["probes"], self.own, limit=10**6)

    def plot(self, kind: str = "bars"):
        """A matplotlib Figure: ``"bars"`` (shares of the change by component, NTP-useful and useless apart) or
        ``"curves"`` (cumulative influence over training, the same groups)."""
        if kind not in ("bars", "curves"):
            raise ValueError(f"plot kind is 'bars' or 'curves', not {kind!r}")
        from ntpflow.experiments import figure_style as fs  # matplotlib: the plot extra

        data = report_data(self)
        with fs.style():
            return (_fig_bars if kind == "bars" else _fig_curves)(data)

    def report(self) -> Path:
        """Write the report (``write_run_report``); returns report.md's path."""
        return write_run_report(self.dir)


def attribution_of(path: str | Path) -> Attribution:
    """The attribution that ``path`` names: an attribution folder, or a run folder (its ``attribution/``)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if AttributionDir(path).spec.exists():
        return Attribution(path)
    default = RunPaths(path).attribution()  # a run folder's own attribution
    if default.spec.exists():
        return Attribution(default.dir)
    raise ValueError(f"{path} is neither an attribution folder nor a run with one (run ntpflow attribute first)")


def report_data(att: Attribution) -> dict:
    """What the report draws: per mismatch and group (NTP-useful, useless, your directions) the mean share of each
    component over the rows, and the mean cumulative influence curve of each component (own reading, whole batch)."""
    own, probes = att.own, att.summary["probes"]
    bars: dict = {}
    for e in probes:
        sh = shares(e, own)
        if sh is not None:
            bars.setdefault(e["mismatch"], {}).setdefault(GROUPS[e.get("useful")], []).append(sh)
    table = att.table
    # pyarrow.compute functions are generated at import; not in the stubs
    table = table.filter(pc.and_(pc.equal(table["optimizer"], own),  # pyright: ignore[reportAttributeAccessIssue]
                                 pc.equal(table["feature_type"], -1)))  # pyright: ignore[reportAttributeAccessIssue]
    table = table.filter(pc.is_in(  # pyright: ignore[reportAttributeAccessIssue]
        table["component"], value_set=pa.array([*PARTS, "full"])))
    curves: dict = {}
    useful = {(e["pos"], e["feature"]): e.get("useful") for e in probes}
    cols = {k: table[k].to_numpy(zero_copy_only=False) for k in ("step", "pos", "feature", "mismatch", "component",
                                                               "cumulative")}
    for m in set(cols["mismatch"]):
        for group_flag, group in GROUPS.items():
            rows = [j for j in range(len(cols["step"])) if cols["mismatch"][j] == m
                    and useful.get((cols["pos"][j], cols["feature"][j])) is group_flag]
            if not rows:
                continue
            for c in (*PARTS, "full"):
                sel = [j for j in rows if cols["component"][j] == c]
                steps = np.unique(cols["step"][sel])
                by_step = {s: [] for s in steps}
                for j in sel:
                    by_step[cols["step"][j]].append(cols["cumulative"][j])
                curves.setdefault(m, {}).setdefault(group, {})[c] = (
                    steps + 1, np.array([np.mean(by_step[s]) for s in steps]))
    return {"bars": {m: {g: {c: float(np.mean([r[c] for r in rows])) for c in PARTS} | {"n": len(rows)}
                         for g, rows in by.items()} for m, by in bars.items()},
            "curves": curves, "own": own, "steps": att.summary.get("steps")}


def _grid(data: dict, key: str, panel, ylabel: str, title: str, ncol: int = 1):
    """A figure of one panel per mismatch (rows) × group (columns) of ``data[key]``, each drawn by ``panel(ax, v)``."""
    from ntpflow.experiments import figure_style as fs

    mismatches = [m for m in ("centred", "paper") if m in data[key]]
    groups = [g for g in GROUPS.values() if any(g in data[key][m] for m in mismatches)]
    if not groups:
        return None
    fig, axes = fs.figure(3.2 * len(groups) + 1, 2.8 * len(mismatches), len(mismatches), len(groups))
    for row, m in zip(axes, mismatches):
        for ax, g in zip(row, groups):
            v = data[key][m].get(g)
            if v is None:
                ax.set_visible(False)
                continue
            ax.set_title(f"{g}, {MISMATCH_LABELS[m]}{panel(ax, v) or ''}")  # panel: draws, and a title suffix
            ax.axhline(0, color="#000000", lw=0.8)
            ax.set_ylabel(ylabel)
    fs.finish(fig, f"{title} ({data['own']} reading). {fs.SIGN}", ncol=ncol)
    return fig


def _fig_bars(data: dict):
    from ntpflow.experiments import figure_style as fs

    def panel(ax, v):
        xs = range(len(PARTS))
        ax.bar(xs, [v[c] for c in PARTS], color=[fs.COMPONENT_COLORS[c] for c in PARTS], alpha=0.8)
        ax.set_xticks(list(xs), [LABELS[c] for c in PARTS])
        return f" ({v['n']} rows)"

    return _grid(data, "bars", panel, "share of the change",
                 "Which part built each feature: mean share of the change by component")


def _fig_curves(data: dict):
    from ntpflow.experiments import figure_style as fs

    def panel(ax, v):
        for c in (*PARTS, "full"):
            ax.plot(*v[c], color=fs.COMPONENT_COLORS[c], lw=1.4, ls=":" if c == "full" else "-", label=LABELS.get(c, c))
        ax.set_xlabel("training step")

    return _grid(data, "curves", panel, "cumulative influence",
                 "Cumulative influence, mean over the rows of each group", ncol=4)


def write_run_report(path: str | Path) -> Path:
    """Write the report of the attribution at ``path`` (an attribution folder, or a run folder) into its
    ``report/`` folder: figures, report.md, report.html and summary.json. Returns report.md's path."""
    from ntpflow.experiments import figure_style as fs
    from ntpflow.experiments.render import draw_figures, write_documents

    att = attribution_of(path)
    data = report_data(att)
    out = att.dir / "report"
    out.mkdir(exist_ok=True)
    pngs = draw_figures(data, out / "figures", {"influence_bars": _fig_bars, "influence_curves": _fig_curves})
    s = att.summary
    blocks = [("h1", f"Attribution of {att.dir.parent.name}"),
              ("p", f"{len({(e['layer'], e['pos']) for e in s['probes']})} sites, "
                    f"{len({e['feature'] for e in s['probes']})} features, {s.get('steps')} steps; the run's own "
                    f"reading: {att.own}. {fs.SIGN} A share is the component's integrated influence over the change it "
                    "splits (the exact change with the exact account); κ = Σ|components| / |full| says how much "
                    "they cancel (docs/balance.md#conditioning)."),
              ("fig", "influence_bars", "Mean share of the change by component, NTP-useful and useless sites apart."),
              ("fig", "influence_curves", "Cumulative influence over training, mean over each group's rows."),
              ("table", ["row"], [[line] for line in att.lines()], "rows")]
    return write_documents(out, blocks, pngs, {"attribution": str(att.dir), "bars": data["bars"], "own": att.own})


def attribute(run_dir: str | Path, spec: AttributionSpec | Sequence[Site] = (), features: Sequence[str] | None = None,
              *, out: str | Path | None = None, device: str = "auto", progress: bool = True,
              force_unlock: bool = False, **settings) -> Attribution:
    """``ntpflow.attribute``: the attribution of the run at ``run_dir`` (read from its account, or replayed) as
    ``spec`` says (an :class:`~ntpflow.replay.spec.AttributionSpec`, or its sites, features and other ``settings``
    by name: ``readout``, ``directions``, ``matrices``, ...) into ``out`` (default RUN_DIR/attribution; the CLI's
    ``--out``; ``out_dir`` is the same), and the results (:class:`Attribution`)."""
    if "out_dir" in settings:
        if out is not None:
            raise ValueError("give out= (the output folder) once")
        out = settings.pop("out_dir")
    return Attribution(replay_attribute(run_dir, AttributionSpec.of(spec, features, **settings), out_dir=out,
                                        device=device, progress=progress, force_unlock=force_unlock))
