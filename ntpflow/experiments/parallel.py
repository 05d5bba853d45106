"""Run an experiment's independent runs, in this process or in worker processes, and the job of one run."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

import torch

from ntpflow.files import resolve_device
from ntpflow.model.sites import Site
from ntpflow.progress import on_terminal, progress_of
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import AccountSpec, account_for
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run, run_name
from ntpflow.runs.threads import kept_threads
from ntpflow.runs.training import train
from ntpflow.runs.workers import launch


def run_jobs(fn: Callable, jobs: Sequence[tuple], workers: int, desc: str, progress: bool = True) -> list:
    """Call ``fn(*job, stages=...)`` for every job: in order in this process when ``workers == 1``, else in a pool
    of ``workers`` processes (``fn`` must be a module-level function); returns the results in the order of ``jobs``.
    A progress bar (stage lines without a terminal) counts finished jobs and names the runs of the last (its result's
    ``run_dir`` or ``run_dirs``); the first job that raises re-raises here. Without a terminal each job also writes
    its own loops' stage lines (``stages``: they name their run, so the lines of parallel jobs stay apart; on a
    terminal the job bar alone)."""
    stages = progress and not on_terminal()
    if workers == 1:
        results = []
        for job in (bar := progress_of(jobs, desc=desc, unit="job", enabled=progress)):
            results.append(fn(*job, stages=stages))
            bar.set_postfix_str(finished_runs(results[-1]))
        return results
    # CUDA cannot be initialized in a forked child of a process that touched it: where there is a GPU, start fresh
    # workers (on a CPU-only machine the pool forks as before)
    spawn = multiprocessing.get_context("spawn") if torch.cuda.is_available() else None
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
        futures = [pool.submit(fn, *job, stages=stages) for job in jobs]
        bar = progress_of(as_completed(futures), desc=desc, total=len(futures), unit="job", enabled=progress)
        for f in bar:
            bar.set_postfix_str(finished_runs(f.result()))
        return [f.result() for f in futures]


def gpu_count(device: str) -> int:
    """The CUDA GPUs that jobs on ``device`` spread over: every GPU for ``auto``/``cuda`` on a machine with several;
    else 1 (a CPU, one GPU, or a device named with its index)."""
    return torch.cuda.device_count() if device in ("auto", "cuda") and torch.cuda.is_available() else 1


def job_devices(device: str, n_jobs: int, gpus: int = 1) -> list[str]:
    """The device of each of ``n_jobs`` jobs: with several ``gpus``, job i on ``cuda:(i mod gpus)``; else
    ``device`` for every job."""
    return [f"cuda:{i % gpus}" for i in range(n_jobs)] if gpus > 1 else [device] * n_jobs


def train_with_workers(cfg: TrainConfig, run_dir: str | Path, account: AccountSpec, n: int) -> Run:
    """Train (or resume) ``cfg`` into ``run_dir`` with ``account`` as ``n`` workers on this machine (``ntpflow train
    --workers``: gloo on a CPU, NCCL on GPUs, worker i on GPU i); returns the Run. RuntimeError (one line) if a
    worker fails."""
    code = launch(n, ["-q", "train", "--out", str(run_dir), *account.cli_args(), "--set", *cfg.overrides()])
    if code:
        raise RuntimeError(f"the {n} workers training {run_dir} stopped (exit status {code}); rerun to resume")
    return Run.open(run_dir)


def finished_runs(result) -> str:
    """``"finished majority-vanilla-s0, majority-vanilla-s1"`` from a job's result naming its ``run_dir`` or
    ``run_dirs``; empty for any other result."""
    dirs = (result.get("run_dirs") or [result.get("run_dir")]) if isinstance(result, dict) else []
    names = [run_name(d) for d in dirs if d]
    return f"finished {', '.join(names)}" if names else ""


def run_threads(device: str, workers: int) -> int:
    """Torch threads for each of ``workers`` parallel runs on ``device``. On a CPU always 1: a CPU's sums depend on
    the thread count (``ntpflow/runs/threads.py``), so a run's bits must not depend on how many runs were queued beside
    it or on the machine's cores. On a GPU, where the threads only feed it, the cores are shared out."""
    return 1 if resolve_device(device).type == "cpu" else max(1, (os.cpu_count() or 1) // workers)


def one_run(cfg_dict: dict, run_dir: str, sites: list[tuple[int, int]], features: list[str], device: str,
            threads: int, reading: str = "exact", readout: int | None = 256, *, stages: bool = False) -> dict:
    """The job of one run (for :func:`run_jobs`): train it (with the exact account at ``sites``, ``train --account``,
    unless the run was begun without it), probe its final and step-0 weights and, with ``sites``, attribute it at
    ``sites`` × ``features`` (read from its account, or replayed; ``reading`` and the exact account's ``readout``,
    256 as the committed results were replayed, or the run's evaluation set if smaller: see
    ``ntpflow.replay.attribution.attribute``); each
    stage skips itself when done, and reports its progress as stage lines when ``stages``. Runs on ``threads`` torch
    threads and gives the caller its count back."""
    cfg = TrainConfig.from_dict(cfg_dict)
    readout = min(readout, cfg.n_eval) if reading == "exact" and readout else None
    tracked = [Site(*s) for s in sites]
    with on_threads(threads):  # the exact account is kept while training (no replay) unless the run began without it
        run = train(cfg, run_dir, progress=stages,
                    account=account_for(run_dir, tracked, readout) if reading == "exact" else None)
        load_or_probe(run, "final", device)
        load_or_probe(run, "init", device)
        if sites:
            attribute(run.dir, AttributionSpec(tracked, features, reading=reading, readout=readout), device=device,
                      progress=stages)
    return {"run_dir": run_dir}


@contextmanager
def on_threads(n: int | None) -> Iterator[None]:
    """Inside: ``n`` torch threads (None: as they are); the caller's count comes back on leaving."""
    with kept_threads():
        if n:
            torch.set_num_threads(n)
        yield
