"""Residual-stream sites and the layer/position convention used everywhere in ntpflow.

Convention:
    resid[0]        = token embedding + position embedding  (``blocks.0.hook_resid_pre``)
    resid[k]        = output of block k-1 = input of block k (``blocks.{k}.hook_resid_pre``), 0 < k < n_layer
    resid[n_layer]  = output of the last block, taken *before* the final LayerNorm
                      (``blocks.{n_layer-1}.hook_resid_post``)
    Logits at position p predict token p+1; "the loss at position p" is that prediction. Position 0 is BOS.
"""

from collections.abc import Iterable
from dataclasses import dataclass


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
        """Parse ``"layer:pos"``, e.g. ``"1:5"``."""
        try:
            layer, pos = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"cannot parse site {text!r}; expected LAYER:POS, e.g. 1:5") from None
        return cls(layer, pos)


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
    """Parse a site list: ``"1:5,2:7"`` or ranges ``"1-2:2-19"`` (layers × positions, inclusive)."""
    sites: list[Site] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            lay, pos = part.split(":")
            layers = _parse_range(lay)
            positions = _parse_range(pos)
        except ValueError:
            raise ValueError(f"cannot parse sites {spec!r}; expected e.g. 1:5,2:7 or 1-2:2-19") from None
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
