"""Residual-stream sites and the layer/position convention used everywhere in ntpflow.

Convention:
    resid[0]        = token embedding + position embedding  (``blocks.0.hook_resid_pre``)
    resid[k]        = output of block k-1 = input of block k (``blocks.{k}.hook_resid_pre``), 0 < k < n_layer
    resid[n_layer]  = output of the last block, taken *before* the final LayerNorm
                      (``blocks.{n_layer-1}.hook_resid_post``)
    Logits at position p predict token p+1; "the loss at position p" is that prediction. Position 0 is BOS.
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass

_HOOK = re.compile(r"^blocks\.(\d+)\.hook_resid_(pre|post)$")
_OLD_FEATURE = re.compile(r"^(is_majority|prev_is)_<(\d+)>$")


@dataclass(frozen=True, order=True)
class Site:
    """One residual-stream site: ``layer`` in 0..n_layer (see module docstring), ``pos`` a token position."""

    layer: int
    pos: int

    def hook_name(self, n_layer: int) -> str:
        """TransformerLens name of this residual, e.g. ``blocks.1.hook_resid_pre``."""
        return resid_hook_name(self.layer, n_layer)

    def check(self, n_layer: int, n_pos: int) -> None:
        """Raise ValueError if the site is outside a model with ``n_layer`` blocks and ``n_pos`` positions."""
        if not (0 <= self.layer <= n_layer):
            raise ValueError(f"site {self} out of range: layer must be in 0..{n_layer}")
        if not (0 <= self.pos < n_pos):
            raise ValueError(f"site {self} out of range: pos must be in 0..{n_pos - 1}")

    @classmethod
    def parse(cls, text: str) -> "Site":
        """Parse ``"layer:pos"`` (e.g. ``"1:5"``) or ``"HOOK:pos"`` with a TransformerLens residual hook name
        (``"blocks.0.hook_resid_post:4"`` = ``Site(1, 4)``, see :func:`parse_layer`)."""
        try:
            layer, pos = text.split(":")
            return cls(parse_layer(layer), int(pos))
        except ValueError as e:
            raise ValueError(f"cannot parse site {text!r}; expected LAYER:POS, e.g. 1:5 or "
                             f"blocks.0.hook_resid_post:5{_why(e)}") from None


def _why(e: ValueError) -> str:
    """The reason of a hook-name error, for the one-line message (empty for a plain parse error)."""
    return f" ({e})" if "hook" in str(e) else ""


def parse_layer(text: str) -> int:
    """The residual index of ``text``: an integer (``"1"``), or a TransformerLens residual hook name:
    ``blocks.K.hook_resid_pre`` = K, ``blocks.K.hook_resid_post`` = K + 1 (see the module docstring). Other hooks
    (``ln_final.hook_normalized``, attention or MLP outputs, ...) are not residual sites: ValueError."""
    text = text.strip()
    m = _HOOK.match(text)
    if m:
        return int(m.group(1)) + (m.group(2) == "post")
    if text.startswith(("blocks.", "hook_", "ln_final")):
        raise ValueError(f"{text!r} is not a residual hook; sites are blocks.K.hook_resid_pre or "
                         "blocks.K.hook_resid_post")
    return int(text)


def checked_sites(sites: Iterable[Site], n_layer: int, n_pos: int) -> list[Site]:
    """The distinct ``sites``, sorted, each checked to lie in a model with ``n_layer`` blocks and ``n_pos`` positions
    (ValueError otherwise)."""
    out = sorted(set(sites))
    for s in out:
        s.check(n_layer, n_pos)
    return out


def resid_hook_name(layer: int, n_layer: int) -> str:
    """TransformerLens hook name of ``resid[layer]`` (see module docstring)."""
    if not (0 <= layer <= n_layer):
        raise ValueError(f"layer {layer} out of range 0..{n_layer}")
    if layer == n_layer:
        return f"blocks.{n_layer - 1}.hook_resid_post"
    return f"blocks.{layer}.hook_resid_pre"


def parse_sites(spec: str) -> list[Site]:
    """Parse a site list: ``"1:5,2:7"`` or ranges ``"1-2:2-19"`` (layers × positions, inclusive); a layer may be a
    TransformerLens residual hook name, ``"blocks.0.hook_resid_post:4"`` = ``Site(1, 4)`` (:func:`parse_layer`)."""
    sites: list[Site] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lay, pos = part.split(":")
            layers = _parse_range(lay) if "." not in lay else range(parse_layer(lay), parse_layer(lay) + 1)
            positions = _parse_range(pos)
        except ValueError as e:
            raise ValueError(f"cannot parse sites {spec!r}; expected e.g. 1:5,2:7, 1-2:2-19 or "
                             f"blocks.0.hook_resid_post:4{_why(e)}") from None
        if not layers or not positions:
            raise ValueError(f"empty range in sites {spec!r}")
        sites.extend(Site(k, p) for k in layers for p in positions)
    if not sites:
        raise ValueError(f"no sites in {spec!r}")
    return sorted(set(sites))


def _parse_range(text: str) -> range:
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return range(lo, hi + 1)
    return range(int(text), int(text) + 1)


def feature_name(name: str) -> str:
    """The spelling of a feature name that needs no shell quoting: the toy tasks' names before 0.2
    (``is_majority_<0>``, ``prev_is_<0>``) become ``is_majority_0``, ``prev_is_0``; any other name is returned as
    it is. Every reader of a feature name (probes, attribute, reports of old results) goes through this."""
    m = _OLD_FEATURE.match(name)
    return f"{m.group(1)}_{m.group(2)}" if m else name
