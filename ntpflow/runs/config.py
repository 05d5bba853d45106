"""Training configuration: a typed, frozen dataclass with ``key=value`` overrides and a stable hash."""

import ast
import hashlib
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal

from ntpflow.tasks import task_class
from ntpflow.tasks.othello_engine import BOARD_SIZES

REGIMES = ("vanilla", "myopic", "untied", "myopic-untied")
_SCHEDULE = ("warmup", "decay", "final_lr_frac")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (model, data, optimiser, schedule).

    ``regime`` picks the ablation: ``myopic`` cuts pre-caching (attention mode ``myopic_mode``), ``untied`` cuts
    circuit sharing across the split: positions < ``split_at`` and >= ``split_at`` get separate parameters
    (``split_at=0`` unties every position). ``seed`` drives the initialisation and the data order; ``data_seed``
    (default: ``seed``) the generated train/eval sets.
    """

    task: str = "majority"
    corpus: str = ""  # the stories task's corpus: a path, "sample", "generated[:N]" or "hf"; unused by the synthetic tasks
    vocab_size: int = 4096  # the stories task's BPE vocabulary (when the hub tokenizer is unreachable)
    board_size: int = 8  # the othello task's board: 8 (the paper's) or 6 (a fallback, not the paper's setting)
    regime: Literal["vanilla", "myopic", "untied", "myopic-untied"] = "vanilla"
    myopic_mode: Literal["kv", "resid"] = "kv"
    split_at: int = 10
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    steps: int = 3000
    batch_size: int = 256
    lr: float = 1e-3
    optimizer: Literal["adam", "sgd"] = "adam"  # Adam (the paper's), or SGD with ``momentum`` (linear in the
    momentum: float = 0.0  # gradients, so the optimizer's own split of a step into the components is well-posed)
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup: int = 0  # learning-rate schedule (off by default): linear warmup over the first ``warmup`` steps,
    decay: Literal["none", "linear", "cosine"] = "none"  # then this decay to ``lr * final_lr_frac`` at the last step
    final_lr_frac: float = 0.1
    n_train: int = 102_400
    n_eval: int = 10_240
    seed: int = 0
    data_seed: int | None = None
    eval_every: int = 500
    ckpt_every: int = 500
    log_every: int = 50
    device: str = "auto"

    def __post_init__(self):
        for name in ("lr", "momentum", "beta1", "beta2", "adam_eps", "final_lr_frac"):  # 1 and 1.0 must hash alike
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.task.startswith("file:"):  # a task file: its absolute path, so that any working directory reopens it
            object.__setattr__(self, "task", "file:" + str(Path(self.task.removeprefix("file:")).resolve()))
        task_class(self.task)  # a built-in task or an importable Task subclass (one-line ValueError otherwise)
        if self.board_size not in BOARD_SIZES:
            raise ValueError(f"board_size must be 6 or 8, got {self.board_size!r}")
        if self.board_size != 8 and "board_size" not in task_class(self.task).config_fields:
            raise ValueError(f"board_size applies to the othello task only, not to {self.task!r}")
        if self.regime not in REGIMES:
            raise ValueError(f"unknown regime {self.regime!r}; choose one of {REGIMES}")
        if self.myopic_mode not in ("kv", "resid"):
            raise ValueError(f"unknown myopic_mode {self.myopic_mode!r}; choose 'kv' or 'resid'")
        for name in ("vocab_size", "steps", "batch_size", "n_train", "n_eval", "eval_every", "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.batch_size > self.n_train:
            raise ValueError(f"batch_size={self.batch_size} exceeds n_train={self.n_train}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose 'adam' or 'sgd'")
        if self.momentum and self.optimizer != "sgd":
            raise ValueError("momentum applies to optimizer=sgd (Adam's first moment is beta1)")
        if self.optimizer == "sgd" and self.scheduled:
            raise ValueError("optimizer=sgd takes a constant learning rate: drop warmup/decay")
        for name in ("momentum", "beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if not 0 < self.adam_eps < math.inf:
            raise ValueError(f"adam_eps must be positive and finite, got {self.adam_eps}")
        for name in ("n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.decay not in ("none", "linear", "cosine"):
            raise ValueError(f"unknown decay {self.decay!r}; choose 'none', 'linear' or 'cosine'")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ValueError(f"final_lr_frac must lie in [0, 1], got {self.final_lr_frac}")
        for name in ("seed", "data_seed", "split_at"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate follows a schedule (``warmup`` or ``decay``), not the constant ``lr``."""
        return self.warmup > 0 or self.decay != "none"

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): ``lr`` times the warmup ramp ``min(1, (step + 1) /
        warmup)`` times the decay factor, which falls from 1 after the warmup to ``final_lr_frac`` at the last step
        (linearly or along a half cosine)."""
        ramp = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        if self.decay == "none":
            return self.lr * ramp
        x = min(1.0, max(0.0, (step - self.warmup) / max(1, self.steps - 1 - self.warmup)))
        shape = 1 - x if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * x))
        return self.lr * ramp * (self.final_lr_frac + (1 - self.final_lr_frac) * shape)

    @property
    def own_rows(self) -> str:
        """The ``optimizer`` column of the influence rows that split this run's real steps: "adam", "momentum" (SGD
        with momentum) or "sgd" (plain SGD, whose split is the SGD direction itself)."""
        return "adam" if self.optimizer == "adam" else "momentum" if self.momentum else "sgd"

    @property
    def myopic(self) -> str:
        """The model's myopic mode: ``myopic_mode`` in the myopic regimes, else ``"none"``."""
        return self.myopic_mode if self.regime.startswith("myopic") else "none"

    @property
    def untied(self) -> bool:
        """Whether the regime unties the parameters across the split at ``split_at``."""
        return self.regime.endswith("untied")

    def to_dict(self) -> dict:
        """The fields as a plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Build from a dict of fields; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config key(s) {sorted(unknown)}; known keys: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_values(cls, d: dict) -> "TrainConfig":
        """Like :meth:`from_dict` for values parsed from a file (JSON/TOML): each is checked against its field's type
        and coerced exactly as a ``--set key=value`` override (``steps = 30.0`` is refused, ``lr = 1`` becomes 1.0)."""
        types_ = typing.get_type_hints(cls)
        unknown = set(d) - set(types_)
        if unknown:
            raise ValueError(f"unknown config key(s) {sorted(unknown)}; known keys: {sorted(types_)}")
        return cls(**{k: _check_type(k, v, v, types_[k]) for k, v in d.items()})

    def hash(self) -> str:
        """SHA-256 of the canonical JSON of the fields that change results (not ``device`` or logging)."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("device", "log_every")}
        if not self.scheduled:  # the schedule's fields are off: runs from before they existed keep their hash
            for k in _SCHEDULE:
                d.pop(k)
        if self.optimizer == "adam":  # Adam, the default: runs from before the optimizer choice keep their hash
            d.pop("optimizer"), d.pop("momentum")
        if self.board_size == 8:  # the 8x8 board: runs from before board_size existed keep their hash
            d.pop("board_size")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def apply_overrides(cfg, overrides: list[str]):
    """Return ``cfg`` with ``["key=value", ...]`` applied; values are Python literals, checked against the type."""
    types_ = typing.get_type_hints(type(cfg))
    changes = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} is not of the form key=value")
        if key not in types_:
            raise ValueError(f"unknown config key {key!r}; known keys: {sorted(types_)}")
        changes[key] = _coerce(key, raw.strip(), types_[key])
    return replace(cfg, **changes)


def _coerce(key: str, raw: str, typ):
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare string such as regime=myopic
    return _check_type(key, value, raw, typ)


def _check_type(key: str, value, raw, typ):
    """``value`` if it fits the field type ``typ`` (an int where a float is expected becomes a float), else a
    ValueError naming ``key`` and the input ``raw``."""
    allowed = typing.get_args(typ) if isinstance(typ, types.UnionType) or typing.get_origin(typ) else (typ,)
    if typing.get_origin(typ) is Literal:
        allowed = (str,)
    for t in allowed:
        if t is type(None) and value is None:
            return None
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(t, type) and t is not type(None) and isinstance(value, t) and not (
            t is int and isinstance(value, bool)
        ):
            return value
    raise ValueError(f"bad value for {key}: {raw!r} (expected {typ})")
