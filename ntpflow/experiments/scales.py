"""What the experiments share about their scales: a scale by name, and the grid of tracked sites."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from ntpflow.model.sites import Site

S = TypeVar("S")


def resolve_scale(scale: str | S, scales: Mapping[str, S], kind: type[S]) -> S:
    """``scale`` itself if it is a ``kind`` (an experiment's scale dataclass), else the scale of that name in
    ``scales``; ValueError for an unknown name, TypeError for anything else."""
    if isinstance(scale, kind):
        return scale
    if not isinstance(scale, str):
        raise TypeError(f"scale must be a name or a {kind.__name__}, got {type(scale).__name__}")
    if scale not in scales:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(scales)}")
    return scales[scale]


def site_grid(layers: Iterable[int], positions: Iterable[int]) -> tuple[Site, ...]:
    """``Site(layer, pos)`` for every layer × position, layer-major."""
    positions = tuple(positions)
    return tuple(Site(k, p) for k in layers for p in positions)
