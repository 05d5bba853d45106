"""TransformerLens-style hook points: identity modules with stable dotted names.

A hook function receives ``(activation, hook)`` and returns a replacement tensor or ``None``.
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]


class HookPoint(nn.Identity):
    """Identity module marking an activation; ``name`` is its TransformerLens name (set by the root model)."""

    name: str = ""

    def add_hook(self, fn: HookFn):
        """Register ``fn(act, hook) -> act | None`` on this point; returns a removable handle."""
        return self.register_forward_hook(lambda _mod, _inp, out: fn(out, self))

    @property
    def active(self) -> bool:
        """Whether any hook is registered here (used to skip work that only a hook would see)."""
        return bool(self._forward_hooks)


def name_hook_points(root: nn.Module) -> dict[str, HookPoint]:
    """Give every HookPoint under ``root`` its dotted module name; return ``{name: point}``."""
    points = {}
    for name, mod in root.named_modules():
        if isinstance(mod, HookPoint):
            mod.name = name
            points[name] = mod
    return points


@contextmanager
def hooks(root: nn.Module, fwd: Iterable[tuple[str, HookFn]]) -> Iterator[None]:
    """Temporarily add forward hooks ``[(hook_name, fn), ...]``; always removed on exit."""
    points = {n: m for n, m in root.named_modules() if isinstance(m, HookPoint)}
    handles = []
    try:
        for name, fn in fwd:
            if name not in points:
                raise ValueError(f"unknown hook point {name!r}")
            handles.append(points[name].add_hook(fn))
        yield
    finally:
        for h in handles:
            h.remove()


def run_with_cache(
    root: nn.Module, tokens: torch.Tensor, names: Iterable[str] | None = None, **kwargs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run ``root(tokens, **kwargs)`` and return ``(output, {hook_name: detached activation})``.

    ``names=None`` caches every hook point. Activations keep the position dimension.
    """
    cache: dict[str, torch.Tensor] = {}
    wanted = None if names is None else set(names)
    all_names = [n for n, m in root.named_modules() if isinstance(m, HookPoint)]
    selected = [n for n in all_names if wanted is None or n in wanted]
    if wanted is not None and wanted - set(all_names):
        raise ValueError(f"unknown hook points: {sorted(wanted - set(all_names))}")

    def save(act, hook):
        cache[hook.name] = act.detach()

    with hooks(root, [(n, save) for n in selected]):
        out = root(tokens, **kwargs)
    return out, cache
