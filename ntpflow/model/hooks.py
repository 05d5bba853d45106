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


_ATTN = ("q", "k", "v", "z", "pattern")  # TransformerLens short names that live under blocks.L.attn
_MLP = ("pre", "post")  # ... and under blocks.L.mlp


def tl_hook_name(name: str, layer: int | None = None) -> str:
    """TransformerLens's full hook name of a short one: ``("resid_pre", 1)`` -> ``blocks.1.hook_resid_pre``,
    ``("pattern", 0)`` -> ``blocks.0.attn.hook_pattern``, ``("post", 0)`` -> ``blocks.0.mlp.hook_post``,
    ``"embed"`` -> ``hook_embed``; a full name is returned as it is."""
    if "." in name or name.startswith("hook_"):
        return name
    if layer is None:
        return f"hook_{name}"
    inner = "attn." if name in _ATTN else "mlp." if name in _MLP else ""
    return f"blocks.{layer}.{inner}hook_{name}"


class ActivationCache(dict):
    """``{hook_name: activation}`` that also takes TransformerLens's short keys: ``cache["resid_pre", 1]``,
    ``cache["pattern", 0]``, ``cache["embed"]``."""

    def __getitem__(self, key):
        if isinstance(key, tuple):
            return super().__getitem__(tl_hook_name(*key))
        return super().__getitem__(key if super().__contains__(key) else tl_hook_name(key))


def run_with_cache(
    root: nn.Module, tokens: torch.Tensor, names: Iterable[str] | None = None, **kwargs
) -> tuple[torch.Tensor, ActivationCache]:
    """Run ``root(tokens, **kwargs)`` and return ``(output, cache)``: every hook point's detached activation, by
    hook name (:class:`ActivationCache`). ``names=None`` caches every hook point. Shapes are TransformerLens's
    (``[batch, pos, ...]``; attention patterns ``[batch, head, query, key]``)."""
    cache = ActivationCache()
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
