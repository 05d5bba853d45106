"""The torch thread count a run trains with, per range of steps: training records it, resumes and replays follow it.

On a CPU the sums inside a matmul are split by thread, so the same step with another thread count can differ in
the last bits, training amplifies that, and a replay with another count drifts from the run and fails its
bit-for-bit check. Training writes ``RUN_DIR/threads.json`` at every start and resume::

    {"device": "cpu", "segments": [[0, 2], [2400, 1]]}    # steps 0..2399 with 2 threads, 2400.. with 1

A resumed run goes on with the count of the step before its resume point, whatever this process's count, so an
interrupted run ends in the bits of an uninterrupted one (``continue_threads``); only an explicit count starts a new
segment. A replay (``ntpflow attribute``, ``ntpflow balance``) sets the recorded count at each segment's first step
and restores the caller's count at the end. Runs trained on a GPU, or before this file existed, are replayed as they
are.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ntpflow.files import read_json, write_json
from ntpflow.runs.run import RunPaths

log = logging.getLogger(__name__)


def continue_threads(run_dirs: "list[Path] | tuple[Path, ...]", start: int, device: torch.device,
                     threads: int | None = None) -> int:
    """Set and record the torch thread count that training of ``run_dirs`` (one run, or a group's members, which
    share their record) uses from step ``start`` on ``device``; return it. ``threads=None``: on a CPU, a resume
    (``start > 0``) continues with the recorded count of step ``start - 1``; a fresh run, or one without a record,
    keeps this process's count. An explicit ``threads`` is used as given. Segments from ``start`` on, written by a
    run that was killed, are dropped. Wrap the caller in ``kept_threads()`` to restore its count afterwards."""
    path = RunPaths(run_dirs[0]).threads_path
    old = read_json(path) if path.exists() else {"device": None, "segments": []}
    segments = [s for s in old["segments"] if s[0] < start]
    on_cpu = torch.device(device).type == "cpu"
    if threads is None and on_cpu and old["device"] == "cpu" and segments:
        threads = segments[-1][1]
        if threads != torch.get_num_threads():
            log.info("%s: steps %d.. with %d torch threads, as it trained before", run_dirs[0], start, threads)
    if threads is not None and on_cpu:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    if not segments or segments[-1][1] != threads:
        segments.append([start, threads])
    for d in run_dirs:
        write_json(RunPaths(d).threads_path, {"device": torch.device(device).type, "segments": segments})
    return threads


@contextmanager
def kept_threads() -> Iterator:
    """Restore this process's torch thread count on leaving (around ``continue_threads``)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def follow_threads(run_dir: Path, device: torch.device) -> Iterator:
    """``with follow_threads(run_dir, device) as at: ... at(step) ...``: before each replayed step, ``at(step)``
    sets the thread count the run trained that step with (a no-op on a GPU or for a run without a record)."""
    path = RunPaths(run_dir).threads_path
    record = read_json(path) if path.exists() else None
    if record is None or record["device"] != "cpu" or torch.device(device).type != "cpu":
        yield lambda step: None
        return
    segments = record["segments"]

    def at(step: int) -> None:
        n = next((t for s, t in reversed(segments) if s <= step), None)  # None: trained before the record
        if n is not None and n != torch.get_num_threads():
            log.info("step %d: %d torch threads, as the run trained it", step, n)
            torch.set_num_threads(n)

    with kept_threads():
        yield at
