"""Sweeps: a grid of training runs, each in its own directory, re-entrant, on a local pool or a Slurm cluster.

A spec is a JSON or TOML file (TOML needs Python ≥ 3.11)::

    name = "toy-grid"
    probe = true                      # also fit ridge probes on the final weights (default false)
    retries = 1                       # extra attempts for a run whose worker died or failed (default 1)
    [grid]                            # TrainConfig fields -> list of values: the cartesian product
    task = ["majority", "cond_majority"]
    regime = ["vanilla", "myopic"]
    seed = [0, 1, 2]
    [settings]                        # TrainConfig fields shared by every run
    steps = 300
    [slurm]                           # options of the submitit executor (ignored locally)
    timeout_min = 60

Every run lives in ``OUT/runs/<name>``, where the name spells the grid values (``task=majority,regime=myopic,seed=0``).
Finished runs are skipped, so a sweep can be re-entered; an interrupted run resumes from its checkpoint. Each run
executes in its own process (``python -m ntpflow.runs.sweep RUN_DIR``), so a killed worker costs only its own run: it is
retried, then marked failed (``RUN_DIR/FAILED`` with the error) while the others go on. ``OUT/results.parquet``
gathers one tidy row per run: the grid values, the status and the final metrics.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ntpflow.files import atomic_write, ensure_writable_dir, read_json, resolve_device, write_json
from ntpflow.probes import ProbeSet
from ntpflow.progress import progress_of
from ntpflow.runs.config import TrainConfig, _check_type
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import RunPaths
from ntpflow.runs.training import train

log = logging.getLogger(__name__)

EXECUTORS = ("local", "submitit", "submitit-local")


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep spec (see the module docstring)."""

    name: str
    grid: dict[str, list]
    settings: dict = field(default_factory=dict)
    probe: bool = False
    retries: int = 1
    slurm: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> SweepSpec:
        """Read a JSON or TOML spec file (name defaults to the file stem); a bad file is a one-line error."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"missing sweep spec {path}")
        try:
            if path.suffix == ".toml":
                if sys.version_info < (3, 11):  # tomllib is new in Python 3.11
                    raise ModuleNotFoundError("No module named 'tomllib'")
                import tomllib

                raw = tomllib.loads(path.read_text())
            else:
                raw = json.loads(path.read_text())
        except (ValueError, ImportError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            raise ValueError(f"cannot parse sweep spec {path}: {e}") from None
        return cls.from_dict(raw, default_name=path.stem)

    @classmethod
    def from_dict(cls, raw: dict, default_name: str = "sweep") -> SweepSpec:
        """Validate a parsed spec (keys, grid, retries, every grid point's TrainConfig) and build it."""
        known = {"name", "grid", "settings", "probe", "retries", "slurm"}
        if unknown := set(raw) - known:
            raise ValueError(f"unknown sweep spec key(s) {sorted(unknown)}; known: {sorted(known)}")
        grid = raw.get("grid") or {}
        if not grid or not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError("a sweep spec needs a [grid] of TrainConfig fields, each a non-empty list of values")
        grid = {k: _unique_values(k, v) for k, v in grid.items()}
        spec = cls(name=str(raw.get("name", default_name)), grid=grid,
                   settings=dict(raw.get("settings") or {}), probe=bool(raw.get("probe", False)),
                   retries=int(raw.get("retries", 1)), slurm=dict(raw.get("slurm") or {}))
        if spec.retries < 0:
            raise ValueError(f"retries must be >= 0, got {spec.retries}")
        if both := set(spec.grid) & set(spec.settings):
            raise ValueError(f"field(s) {sorted(both)} are both in [grid] and [settings]")
        spec.configs()  # every combination must be a valid TrainConfig
        return spec

    def points(self) -> list[dict]:
        """The grid's combinations, in spec order: [{field: value}, ...]."""
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*(self.grid[k] for k in keys))]

    def configs(self) -> list[tuple[str, TrainConfig]]:
        """(run name, TrainConfig) of every grid point."""
        out = []
        for point in self.points():
            try:
                cfg = TrainConfig.from_values({**self.settings, **point})
            except (TypeError, ValueError) as e:
                raise ValueError(f"invalid sweep point {point}: {e}") from None
            out.append((run_name(point), cfg))
        return out


def _unique_values(key: str, values: list) -> list:
    """A grid list checked and coerced like ``--set key=value`` (``lr = [1, 1.0]`` is one value), duplicates dropped
    with a warning, so that every grid point runs once."""
    types_ = typing.get_type_hints(TrainConfig)
    if key not in types_:
        raise ValueError(f"unknown config key {key!r} in [grid]; known keys: {sorted(types_)}")
    out = []
    for v in values:
        try:
            v = _check_type(key, v, v, types_[key])
        except ValueError as e:
            raise ValueError(f"[grid] {e}") from None
        if v in out:
            log.warning("sweep grid: %s=%r is listed twice; it runs once", key, v)
        else:
            out.append(v)
    return out


def run_name(point: dict) -> str:
    """Directory name of a grid point, e.g. ``task=majority,regime=myopic,seed=0`` (``/`` and spaces replaced)."""
    return ",".join(f"{k}={v}" for k, v in point.items()).replace("/", "_").replace(" ", "_")


def status(run_dir: Path) -> str:
    """``done``, ``failed`` or ``pending``."""
    paths = RunPaths(run_dir)
    if paths.done_path.exists() and (not _wants_probe(run_dir) or ProbeSet.saved(paths.probes_dir("final"))):
        return "done"
    return "failed" if paths.failed_path.exists() else "pending"


def _wants_probe(run_dir: Path) -> bool:
    meta = RunPaths(run_dir).sweep_path
    return meta.exists() and bool(read_json(meta).get("probe"))


def execute_run(run_dir: str | Path) -> None:
    """Train (and probe) the run prepared in ``run_dir/sweep.json``: the job each worker process runs."""
    run_dir = Path(run_dir)
    meta = read_json(RunPaths(run_dir).sweep_path)
    run = train(TrainConfig.from_dict(meta["config"]), run_dir, progress=False)
    if meta.get("probe"):
        load_or_probe(run, "final", run.cfg.device)


def run_sweep(spec: SweepSpec | str | Path, out: str | Path, *, executor: str = "local", workers: int = 2,
              progress: bool = True, launcher: Callable[[Path], None] | None = None) -> Path:
    """Run every pending point of ``spec`` into ``out/runs`` and write ``out/results.parquet``; returns ``out``.

    ``executor``: ``local`` (a pool of ``workers`` subprocesses), ``submitit`` (Slurm through submitit, options from
    the spec's ``[slurm]`` table) or ``submitit-local`` (submitit's local executor: the cluster code path on this
    machine). ``launcher`` replaces the per-run subprocess (tests use it to kill workers).
    """

    if not isinstance(spec, SweepSpec):
        spec = SweepSpec.load(spec)
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {EXECUTORS}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if executor != "submitit":  # runs on this machine: their devices must exist here (a cluster node may differ)
        for name, cfg in spec.configs():
            try:
                resolve_device(cfg.device)
            except ValueError as e:
                raise ValueError(f"sweep point {name}: {e}") from None
    out = ensure_writable_dir(out)
    runs_dir = ensure_writable_dir(out / "runs")
    pending = []
    for name, cfg in spec.configs():
        run_dir = runs_dir / name
        run_dir.mkdir(exist_ok=True)
        meta = {"config": cfg.to_dict(), "probe": spec.probe, "sweep": spec.name}
        paths = RunPaths(run_dir)
        if paths.sweep_path.exists() and read_json(paths.sweep_path)["config"] != meta["config"]:
            raise ValueError(f"{run_dir} holds another config; use another output folder")
        write_json(paths.sweep_path, meta)
        if status(run_dir) != "done":
            paths.failed_path.unlink(missing_ok=True)  # re-entering retries failed runs
            pending.append(run_dir)
    log.info("sweep %s: %d runs, %d pending", spec.name, len(spec.configs()), len(pending))
    if executor == "local":
        launch = launcher or _subprocess_launch
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(_with_retries, launch, d, spec.retries): d for d in pending}
            for f in progress_of(as_completed(futures), total=len(futures), enabled=progress, desc=f"sweep {spec.name}",
                                 unit="run"):
                f.result()
    else:
        _submitit(spec, pending, executor, workers, out)
    gather(spec, out)
    return out


def _subprocess_launch(run_dir: Path) -> None:
    """``python -m ntpflow.runs.sweep RUN_DIR --parent PID``: the worker dies with this process (see :func:`main`)."""
    proc = subprocess.run([sys.executable, "-m", "ntpflow.runs.sweep", str(run_dir), "--parent", str(os.getpid())],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        raise RuntimeError(f"worker died ({why}): {tail[-1] if tail else 'no output'}")


def _with_retries(launch: Callable[[Path], None], run_dir: Path, retries: int) -> None:
    """Run ``launch(run_dir)`` up to ``1 + retries`` times (a retry resumes from the last checkpoint); on the last
    failure write ``run_dir/FAILED`` with the error instead of raising, so the other runs go on."""
    for attempt in range(retries + 1):
        try:
            launch(run_dir)
            return
        except Exception as e:  # noqa: BLE001 - any failure of one run is recorded, never propagated
            error = str(e) or type(e).__name__
            log.warning("run %s failed (attempt %d of %d): %s", run_dir.name, attempt + 1, retries + 1, error)
    write_json(RunPaths(run_dir).failed_path, {"error": error, "attempts": retries + 1})


def _submitit(spec: SweepSpec, pending: list[Path], executor: str, workers: int, out: Path) -> None:
    try:
        import submitit
    except ImportError:
        raise ValueError("the submitit executors need the 'cluster' extra: pip install 'ntpflow[cluster]'") from None
    folder = out / "submitit"
    if executor == "submitit":
        ex = submitit.AutoExecutor(folder=folder)
        ex.update_parameters(slurm_array_parallelism=workers, **spec.slurm)
    else:
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=int(spec.slurm.get("timeout_min", 60)))

    def launch(run_dir: Path) -> None:
        ex.submit(execute_run, str(run_dir)).result()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for f in [pool.submit(_with_retries, launch, d, spec.retries) for d in pending]:
            f.result()


def gather(spec: SweepSpec, out: str | Path) -> Path:
    """Write ``out/results.parquet``: per run its grid values, ``run``, ``status``, ``error`` and final metrics."""
    out = Path(out)
    rows = []
    for point in spec.points():
        run_dir = out / "runs" / run_name(point)
        row = {**point, "run": run_name(point), "status": status(run_dir), "error": None}
        if row["status"] == "done":
            row.update({k: v for k, v in read_json(RunPaths(run_dir).done_path).items() if k != "step"})
        elif row["status"] == "failed":
            row["error"] = read_json(RunPaths(run_dir).failed_path)["error"]
        rows.append(row)
    buf = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    atomic_write(out / "results.parquet", buf.getvalue().to_pybytes())
    return out / "results.parquet"


def failures(spec: SweepSpec, out: str | Path) -> list[str]:
    """Names of the runs of ``spec`` in ``out`` that are marked failed."""
    return [run_name(p) for p in spec.points() if status(Path(out) / "runs" / run_name(p)) == "failed"]


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` (the sweep) dies, so that a killed sweep leaves no orphan
    writing into a run that its rerun retries (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op). Exits at once if the
    parent is already gone. The signal follows the parent *thread* that started the worker: the sweep's pool threads
    outlive their workers."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m ntpflow.runs.sweep RUN_DIR [--parent PID]`` (with a parent pid, the worker dies
    with that process)."""
    args = sys.argv[1:] if argv is None else list(argv)
    parent = None
    if len(args) == 3 and args[1] == "--parent" and args[2].isdigit():
        parent = int(args.pop(2))
        args.pop(1)
    if len(args) != 1:
        print("usage: python -m ntpflow.runs.sweep RUN_DIR [--parent PID]", file=sys.stderr)
        return 2
    if parent is not None:
        die_with_parent(parent)
    execute_run(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
