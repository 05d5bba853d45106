"""Where training metrics go: ``metrics.jsonl`` in the run directory always (the record), plus optional sinks.

Sinks are switched on by name (``ntpflow train --track tensorboard,wandb``) or passed as objects with
``log(record: dict)`` and ``close()``. A record is ``{"step": int, "kind": "train" | "eval", <metric>: float, ...}``.
TensorBoard needs the ``tensorboard`` package and W&B the ``wandb`` package (the ``tracking`` extra); neither is ever
needed to see a result.
"""

from __future__ import annotations

import json
import os
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


def check_sinks(track: Sequence[str | Sink]) -> None:
    """Raise ValueError (one line) for an unknown sink name, a missing package, or W&B without credentials, so that
    training fails before it writes anything."""
    import importlib.util

    unknown = [t for t in track if isinstance(t, str) and t not in SINKS]
    if unknown:
        raise ValueError(f"unknown tracking sink(s) {unknown}; choose from {SINKS}")
    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if name in track and importlib.util.find_spec(module) is None:
            raise ValueError(f"--track {name} needs the {module} package: pip install 'ntpflow[tracking]'")
    if "wandb" in track and not _wandb_credentials():
        raise ValueError("--track wandb: not logged in to W&B; run 'wandb login', set WANDB_API_KEY, or set "
                         "WANDB_MODE=offline")


def _wandb_credentials() -> bool:
    """Whether W&B can start without prompting: offline/disabled mode, an API key, or a netrc entry for its host."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        # a URL without a host: "" names no machine, so only a default entry matches (as for None)
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def make_sinks(track: Sequence[str | Sink], run_dir: Path, config: dict) -> list[Sink]:
    """Sinks from names (see ``SINKS``) or ready objects; unknown names raise ValueError before anything runs."""
    check_sinks(track)
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
