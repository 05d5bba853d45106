"""Run an experiment's independent runs, in this process or in worker processes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from ntpflow.files import resolve_device


def run_jobs(fn: Callable, jobs: Sequence[tuple], workers: int, desc: str, progress: bool = True) -> None:
    """Call ``fn(*job)`` for every job: in order in this process when ``workers == 1``, else in a pool of
    ``workers`` processes (``fn`` must be a module-level function). A progress bar counts finished jobs; the first
    job that raises re-raises here."""
    from tqdm.auto import tqdm

    if workers == 1:
        for job in tqdm(jobs, disable=not progress, desc=desc):
            fn(*job)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        for f in tqdm(as_completed(futures), total=len(futures), disable=not progress, desc=desc):
            f.result()


def run_threads(device: str, workers: int) -> int:
    """Torch threads for each of ``workers`` parallel runs on ``device``. On a CPU always 1: a CPU's sums depend on
    the thread count (``ntpflow/runs/threads.py``), so a run's bits must not depend on how many runs were queued beside
    it or on the machine's cores. On a GPU, where the threads only feed it, the cores are shared out."""
    import os


    return 1 if resolve_device(device).type == "cpu" else max(1, (os.cpu_count() or 1) // workers)
