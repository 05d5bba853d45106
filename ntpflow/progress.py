"""Progress of a long loop: a tqdm bar on a terminal; without one (Slurm, nohup, CI, a pipe) stage lines on stderr.

A stage line names the loop (its run), the step out of the total, the time elapsed and the time left::

    majority-vanilla-s0: step 900/3000 (30%), elapsed 1m12s, ETA 2m48s, loss=0.4131

One line when the loop starts, then one whenever both :data:`INTERVAL_S` seconds and :data:`FRACTION` of the steps
have passed since the last (so never every step), or :data:`LONGEST_S` seconds have (so a run of many hours still
says how it stands every few minutes), and one when it ends."""

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized

from tqdm.auto import tqdm

INTERVAL_S = 30.0  # the least time between two stage lines
FRACTION = 0.1  # ... and the least share of the steps between them
LONGEST_S = 600.0  # ... unless this much time has passed since the last line


def on_terminal() -> bool:
    """True where a progress bar can be drawn: stderr is a terminal, or a notebook kernel runs this (tqdm.auto draws
    its widget there)."""
    try:
        if sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False
    return "ipykernel" in sys.modules


def progress_of(iterable: Iterable, *, desc: str, total: int | None = None, initial: int = 0, enabled: bool = True,
             unit: str = "step"):
    """``iterable`` wrapped to report its progress: nothing when not ``enabled``, a tqdm bar on a terminal
    (:func:`on_terminal`), else :class:`StageLines` on stderr. ``desc`` names the loop (the run); ``total`` the
    count at the end (default ``len(iterable)``), ``initial`` the count at the start (a resumed loop). Every kind
    takes ``set_postfix(**kw)``."""
    if total is None and isinstance(iterable, Sized):
        total = initial + len(iterable)
    if not enabled:
        return tqdm(iterable, disable=True)
    if on_terminal():
        return tqdm(iterable, initial=initial, total=total, desc=desc, unit=unit, leave=False)
    return StageLines(iterable, desc=desc, total=total, initial=initial, unit=unit)


def duration(seconds: float) -> str:
    """``75.3`` → ``"1m15s"``, ``4000`` → ``"1h06m"``, ``8.2`` → ``"8s"``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class StageLines:
    """Iterate ``iterable`` and write stage lines to stderr (see the module docstring); ``clock`` (seconds) and
    ``write`` are there for tests."""

    def __init__(self, iterable: Iterable, *, desc: str, total: int | None, initial: int = 0, unit: str = "step",
                 interval: float = INTERVAL_S, fraction: float = FRACTION, longest: float = LONGEST_S,
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] | None = None):
        self.iterable, self.desc, self.total, self.initial, self.unit = iterable, desc, total, initial, unit
        self.interval, self.longest, self.clock = interval, longest, clock
        self.every = max(1, math.ceil(fraction * (total - initial))) if total else 1
        self._write = write
        self.postfix = ""

    def set_postfix(self, **kw) -> None:
        """Values shown at the end of the next line, e.g. ``loss=0.4131``."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def __iter__(self) -> Iterator:
        start = last_t = self.clock()
        n = last_n = self.initial
        self._line(n, "resuming" if n else "starting")
        for item in self.iterable:
            yield item
            n += 1
            now = self.clock()
            due = n - last_n >= self.every or now - last_t >= self.longest
            if now - last_t >= self.interval and due and n != self.total:
                text = f"elapsed {duration(now - start)}"
                if self.total:
                    text += f", ETA {duration((now - start) / (n - self.initial) * (self.total - n))}"
                self._line(n, text)
                last_t, last_n = now, n
        self._line(n, f"done in {duration(self.clock() - start)}")

    def _line(self, n: int, text: str) -> None:
        count = f"{self.unit} {n}/{self.total} ({100 * n // self.total}%)" if self.total else f"{self.unit} {n}"
        line = f"{self.desc}: {count}, {text}" + (f", {self.postfix}" if self.postfix else "")
        if self._write is not None:
            self._write(line)
        else:
            print(line, file=sys.stderr, flush=True)
