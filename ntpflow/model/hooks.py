"""TransformerLens-style hook points: identity modules with stable dotted names.

A hook function receives ``(activation, hook)`` and returns a replacement tensor or ``None``.
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]
# TransformerLens's names_filter: None (every hook point), a name, names, or a predicate on names
NamesFilter = str | Iterable[str] | Callable[[str], bool] | None


class HookPoint(nn.Identity):
    """Identity module marking an activation; ``name`` is its TransformerLens name (set by the root model)."""

    name: str = ""

    def add_hook(self, fn: HookFn):
        """Register ``fn(act, hook) -> act | None`` on this point; returns a removable handle."""
        def hook(_mod: nn.Module, _inp: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            return fn(out, self)

        return self.register_forward_hook(hook)

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
_LN = ("normalized", "scale")  # ... and under blocks.L.ln1 / ln2 (a layer_type), or ln_final without a layer


def tl_hook_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """TransformerLens's full hook name of a short one: ``("resid_pre", 1)`` -> ``blocks.1.hook_resid_pre``,
    ``("pattern", 0)`` -> ``blocks.0.attn.hook_pattern``, ``("post", 0)`` -> ``blocks.0.mlp.hook_post``,
    ``("normalized", 0, "ln1")`` -> ``blocks.0.ln1.hook_normalized``, ``"normalized"`` ->
    ``ln_final.hook_normalized``, ``"embed"`` -> ``hook_embed``; a full name is returned as it is."""
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    if layer is None:
        return f"ln_final.hook_{name}" if name in _LN else f"hook_{name}"
    inner = "attn." if name in _ATTN else "mlp." if name in _MLP else f"{layer_type}." if layer_type else ""
    return f"blocks.{layer}.{inner}hook_{name}"


class ActivationCache(dict):
    """``{hook_name: activation}`` that also takes TransformerLens's short keys: ``cache["resid_pre", 1]``,
    ``cache["pattern", 0]``, ``cache["normalized", 0, "ln1"]``, ``cache["embed"]``; a negative layer counts from the
    end (``cache["resid_post", -1]`` is the last block's), given the model's ``n_layers``."""

    def __init__(self, *args, n_layers: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_layers = n_layers

    def __getitem__(self, key: str | tuple[Any, ...]) -> torch.Tensor:
        if isinstance(key, tuple):
            if len(key) > 1 and isinstance(key[1], int) and key[1] < 0:
                if self.n_layers is None or key[1] < -self.n_layers:
                    raise KeyError(f"layer {key[1]} of a cache of {self.n_layers} layers")
                key = (key[0], key[1] + self.n_layers, *key[2:])
            return super().__getitem__(tl_hook_name(*key))
        return super().__getitem__(key if super().__contains__(key) else tl_hook_name(key))


def _selector(names_filter: NamesFilter) -> Callable[[str], bool]:
    """TransformerLens's ``names_filter`` as a predicate: None (every hook), a name, a list of names, or a callable."""
    if names_filter is None:
        return lambda _name: True
    if callable(names_filter):
        return names_filter
    if isinstance(names_filter, str):
        names_filter = [names_filter]
    wanted = set(names_filter)
    return lambda name: name in wanted


def run_with_cache(
    root: nn.Module, tokens: torch.Tensor, names: NamesFilter = None, *, names_filter: NamesFilter = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, ActivationCache]:
    """Run ``root(tokens, **kwargs)`` and return ``(output, cache)``: the detached activation of every hook point that
    ``names_filter`` (or ``names``: the same) selects, by hook name (:class:`ActivationCache`). As TransformerLens
    takes it: None caches every hook point; a name or a list of names those (an unknown name is a ValueError); a
    callable ``name -> bool`` those it accepts. Shapes are TransformerLens's (``[batch, pos, ...]``; attention
    patterns ``[batch, head, query, key]``)."""
    if names is not None and names_filter is not None:
        raise ValueError("give names_filter or names, not both")
    names_filter = names if names_filter is None else names_filter
    all_names = [n for n, m in root.named_modules() if isinstance(m, HookPoint)]
    if isinstance(names_filter, str | list | tuple | set | frozenset):
        given = [names_filter] if isinstance(names_filter, str) else list(names_filter)
        unknown = sorted(set(given) - set(all_names))
        if unknown:
            raise ValueError(f"unknown hook points: {unknown}")
    keep = _selector(names_filter)
    selected = [n for n in all_names if keep(n)]
    layers = [int(n.split(".")[1]) for n in all_names if n.startswith("blocks.")]
    cache = ActivationCache(n_layers=max(layers) + 1 if layers else None)

    def save(act, hook):
        cache[hook.name] = act.detach()

    with hooks(root, [(n, save) for n in selected]):
        out = root(tokens, **kwargs)
    return out, cache
