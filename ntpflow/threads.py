"""The torch thread count a run trained with, per range of steps: training records it, replays follow it.

On a CPU the sums inside a matmul are split by thread, so the same step with another thread count can differ in
the last bits, and a replay with another count drifts from the run and fails its bit-for-bit check. Training
writes ``RUN_DIR/threads.json`` at every start and resume::

    {"device": "cpu", "segments": [[0, 2], [2400, 1]]}    # steps 0..2399 with 2 threads, 2400.. with 1

and a replay (``ntpflow attribute``, ``ntpflow balance``) sets the recorded count at each segment's first step and
restores the caller's count at the end. Runs trained on a GPU, or before this file existed, are replayed as they are.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .io import read_json, write_json

log = logging.getLogger(__name__)
FILE = "threads.json"


def record_threads(run_dirs: "list[Path] | tuple[Path, ...]", start: int, device: torch.device) -> None:
    """Record that training of each run in ``run_dirs`` continues from step ``start`` with this process's thread
    count on ``device`` (segments from ``start`` on, written by a run that was killed, are dropped)."""
    threads = torch.get_num_threads()
    for d in run_dirs:
        path = Path(d) / FILE
        old = read_json(path) if path.exists() else {"segments": []}
        segments = [s for s in old["segments"] if s[0] < start]
        if not segments or segments[-1][1] != threads:
            segments.append([start, threads])
        write_json(path, {"device": torch.device(device).type, "segments": segments})


@contextmanager
def follow_threads(run_dir: Path, device: torch.device) -> Iterator:
    """``with follow_threads(run_dir, device) as at: ... at(step) ...``: before each replayed step, ``at(step)``
    sets the thread count the run trained that step with (a no-op on a GPU or for a run without a record)."""
    path = Path(run_dir) / FILE
    record = read_json(path) if path.exists() else None
    if record is None or record["device"] != "cpu" or torch.device(device).type != "cpu":
        yield lambda step: None
        return
    segments, before = record["segments"], torch.get_num_threads()

    def at(step: int) -> None:
        n = next((t for s, t in reversed(segments) if s <= step), None)  # None: trained before the record
        if n is not None and n != torch.get_num_threads():
            log.info("step %d: %d torch threads, as the run trained it", step, n)
            torch.set_num_threads(n)

    try:
        yield at
    finally:
        torch.set_num_threads(before)
