"""The architecture of a GPT: sizes, the myopic mode and the position groups (untied parameters)."""

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

Myopic = Literal["none", "kv", "resid"]
Groups = None | slice | torch.Tensor  # per-position group index, see GPT._groups
MYOPIC_MODES = ("none", "kv", "resid")

@dataclass(frozen=True)
class GPTConfig:
    """Architecture of a GPT-2 model.

    Args:
        vocab_size: number of token ids.
        n_ctx: number of positions (sequence length T).
        n_layer, n_head, d_model: GPT-2 sizes; the MLP is 4·d_model wide.
        myopic: ``"none"``; ``"kv"`` (reference code: query t sees stop-gradient keys/values of every other
            position, its own keep their gradient) or ``"resid"`` (Wu et al. 2024: other positions' keys/values
            are re-projected from stop-gradient residuals with live weights). Forward values never change.
        position_groups: ``None`` (shared parameters), ``"untied"`` (one copy per position) or a list of length
            n_ctx giving each position's group id (0..G-1, every id used), e.g. ``[0]*10 + [1]*11``.
        layer_norm_eps: LayerNorm epsilon (GPT-2: 1e-5).
    """

    vocab_size: int
    n_ctx: int
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    myopic: Myopic = "none"
    position_groups: None | str | tuple[int, ...] = None
    layer_norm_eps: float = 1e-5
    groups: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "n_ctx", "n_layer", "n_head", "d_model"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.myopic not in MYOPIC_MODES:
            raise ValueError(f"unknown myopic mode {self.myopic!r}; choose one of {MYOPIC_MODES}")
        pg = self.position_groups
        if pg is None:
            groups = (0,) * self.n_ctx
        elif pg == "untied":
            groups = tuple(range(self.n_ctx))
        elif isinstance(pg, str):
            raise ValueError(f"position_groups must be None, 'untied' or a list of ints, got {pg!r}")
        else:
            groups = tuple(int(g) for g in pg)
            if len(groups) != self.n_ctx:
                raise ValueError(f"position_groups has length {len(groups)}, expected n_ctx={self.n_ctx}")
            if sorted(set(groups)) != list(range(max(groups) + 1)):
                raise ValueError(f"position_groups must use every id 0..G-1, got {sorted(set(groups))}")
            object.__setattr__(self, "position_groups", groups)
        object.__setattr__(self, "groups", groups)

    @property
    def n_groups(self) -> int:
        """Number of position groups G."""
        return max(self.groups) + 1

    @property
    def d_head(self) -> int:
        """Width of one head, d_model // n_head."""
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        """The constructor arguments as a JSON-able dict (without the derived ``groups``)."""
        d = asdict(self)
        d.pop("groups")
        if isinstance(d["position_groups"], tuple):
            d["position_groups"] = list(d["position_groups"])
        return d


def split_groups(n_ctx: int, m: int) -> tuple[int, ...]:
    """The paper's m-untied split: positions < m use group 0, positions >= m use group 1."""
    if not 0 < m < n_ctx:
        raise ValueError(f"split index {m} must be in 1..{n_ctx - 1}")
    return (0,) * m + (1,) * (n_ctx - m)

