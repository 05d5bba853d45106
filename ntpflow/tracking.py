"""Where training metrics go: ``metrics.jsonl`` in the run directory always (the record), plus optional sinks.

Sinks are switched on by name (``ntpflow train --track tensorboard,wandb``) or passed as objects with
``log(record: dict)`` and ``close()``. A record is ``{"step": int, "kind": "train" | "eval", <metric>: float, ...}``.
TensorBoard needs the ``tensorboard`` package and W&B the ``wandb`` package (the ``tracking`` extra); neither is ever
needed to see a result.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

SINKS = ("tensorboard", "wandb")


class Sink(Protocol):
    """A metrics destination: ``log(record)`` for each record, ``close()`` at the end."""

    def log(self, record: dict) -> None:
        """Receive one record (see the module docstring)."""
        ...

    def close(self) -> None:
        """Release the sink's resources (end of training)."""
        ...


class TensorBoardSink:
    """Scalars ``<kind>/<metric>`` at ``step`` in ``run_dir/tensorboard``."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("--track tensorboard needs the tensorboard package: pip install 'ntpflow[tracking]'") \
                from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        """Add each numeric metric of ``record`` as the scalar ``<kind>/<metric>`` at its step."""
        for k, v in record.items():
            if k not in ("step", "kind") and isinstance(v, int | float):
                self.writer.add_scalar(f"{record['kind']}/{k}", v, record["step"])

    def close(self) -> None:
        """Close the SummaryWriter."""
        self.writer.close()


class WandbSink:
    """A W&B run named after the run directory (``WANDB_MODE=offline`` works without a network)."""

    def __init__(self, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ValueError("--track wandb needs the wandb package: pip install 'ntpflow[tracking]'") from None
        self.run = wandb.init(project="ntpflow", name=run_dir.name, dir=str(run_dir), config=config)

    def log(self, record: dict) -> None:
        """Log the metrics of ``record`` as ``<kind>/<metric>`` at its step."""
        self.run.log({f"{record['kind']}/{k}": v for k, v in record.items() if k not in ("step", "kind")},
                     step=record["step"])

    def close(self) -> None:
        """Finish the W&B run."""
        self.run.finish()


def make_sinks(track: Sequence[str | Sink], run_dir: Path, config: dict) -> list[Sink]:
    """Sinks from names (see ``SINKS``) or ready objects; unknown names raise ValueError before anything runs."""
    unknown = [t for t in track if isinstance(t, str) and t not in SINKS]
    if unknown:
        raise ValueError(f"unknown tracking sink(s) {unknown}; choose from {SINKS}")
    sinks = []
    for t in track:
        if t == "tensorboard":
            sinks.append(TensorBoardSink(run_dir))
        elif t == "wandb":
            sinks.append(WandbSink(run_dir, config))
        else:
            sinks.append(t)
    return sinks


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (flushed on ``flush``/``close``) and forwards them to the sinks."""

    def __init__(self, path: Path, sinks: Sequence[Sink] = ()):
        self.file = open(path, "a")  # noqa: SIM115 - closed in close()
        self.sinks = list(sinks)

    def log(self, record: dict) -> None:
        """Append ``record`` to ``metrics.jsonl`` as a JSON line and forward it to every sink."""
        self.file.write(json.dumps(record) + "\n")
        for s in self.sinks:
            s.log(record)

    def flush(self) -> None:
        """Flush the buffered lines to ``metrics.jsonl``."""
        self.file.flush()

    def close(self) -> None:
        """Close ``metrics.jsonl`` and every sink."""
        self.file.close()
        for s in self.sinks:
            s.close()
