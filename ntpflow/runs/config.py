"""Training configuration: a typed, frozen dataclass with ``key=value`` overrides and a stable hash."""

import ast
import hashlib
import inspect
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from ntpflow.tasks import TASKS, make_task, task_class
from ntpflow.tasks.othello_engine import BOARD_SIZES

REGIMES = ("vanilla", "myopic", "untied", "myopic-untied")
_SCHEDULE = ("warmup", "decay", "final_lr_frac")
BUILTIN_SPLIT_AT = 10  # the untied split of the built-in tasks (every run before split_at became the task's default)
_BUILTIN_ONLY = {"corpus": "", "vocab_size": 4096, "board_size": 8}  # fields of built-in tasks, at their defaults


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (model, data, optimiser, schedule).

    ``regime`` picks the ablation: ``myopic`` cuts pre-caching (attention mode ``myopic_mode``), ``untied`` cuts
    circuit sharing across the split: positions < ``split_at`` and >= ``split_at`` get separate parameters
    (``split_at=0`` unties every position; default: 10 for the built-in tasks, the task's ``first_output_pos`` for a
    task of one's own). ``seed`` drives the initialisation and the data order; ``data_seed`` (default: ``seed``) the
    generated train/eval sets. ``task_args``: a task's own parameters, the names in its ``config_fields`` that are
    no field here (``--set n_items=6``), each read by name like a field (``cfg.n_items``).
    """

    task: str = "majority"
    corpus: str = ""  # the stories task's corpus: a path, "sample", "generated[:N]" or "hf"; unused by the synthetic tasks
    vocab_size: int = 4096  # the stories task's BPE vocabulary (when the hub tokenizer is unreachable)
    board_size: int = 8  # the othello task's board: 8 (the paper's) or 6 (a fallback, not the paper's setting)
    regime: Literal["vanilla", "myopic", "untied", "myopic-untied"] = "vanilla"
    myopic_mode: Literal["kv", "resid"] = "kv"
    split_at: int | None = None  # None: the task's default (see above)
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
    task_args: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        for name in ("lr", "momentum", "beta1", "beta2", "adam_eps", "final_lr_frac"):  # 1 and 1.0 must hash alike
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.task.startswith("file:"):  # a task file: its absolute path, so that any working directory reopens it
            object.__setattr__(self, "task", "file:" + str(Path(self.task.removeprefix("file:")).resolve()))
        cls = task_class(self.task)  # a built-in task or an importable Task subclass (one-line ValueError otherwise)
        object.__setattr__(self, "task_args", _task_args(self.task, cls, self.task_args))
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
        if self.split_at is None and self.task in TASKS:
            object.__setattr__(self, "split_at", BUILTIN_SPLIT_AT)
        elif self.untied and self.task not in TASKS:
            self._resolve_split(cls)

    def task_kwargs(self) -> dict:
        """The constructor arguments of the task: its ``config_fields``, from ``task_args`` (its own parameters) or the
        TrainConfig field of that name."""
        args = self.task_args or {}
        return {f: args[f] if f in args else getattr(self, f) for f in task_class(self.task).config_fields}

    def _resolve_split(self, cls) -> None:
        """A task of one's own, untied: ``split_at`` defaults to its ``first_output_pos`` and must fit its length."""
        task = make_task(self.task, **self.task_kwargs())
        T = task.seq_len
        split_at = self.split_at
        if split_at is None:
            if task.first_output_pos < 1:
                raise ValueError(f"split_at: the task's first_output_pos is {task.first_output_pos}; give split_at "
                                 f"(1..{T - 1}, or 0 to untie every position)")
            split_at = int(task.first_output_pos)
            object.__setattr__(self, "split_at", split_at)
            object.__setattr__(self, "_split_from_task", True)  # apply_overrides resolves it again
        if split_at != 0 and not 0 < split_at < T:
            raise ValueError(f"split_at must be 0 (untie every position) or in 1..{T - 1} (the task has {T} "
                             f"positions), got {split_at}")

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
    def myopic(self) -> Literal["none", "kv", "resid"]:
        """The model's myopic mode: ``myopic_mode`` in the myopic regimes, else ``"none"``."""
        return self.myopic_mode if self.regime.startswith("myopic") else "none"

    @property
    def untied(self) -> bool:
        """Whether the regime unties the parameters across the split at ``split_at``."""
        return self.regime.endswith("untied")

    def to_dict(self) -> dict:
        """The fields as a plain dict (``task_args`` only when set; for a task of one's own, without the built-in
        tasks' ``corpus``, ``vocab_size`` and ``board_size`` at their defaults)."""
        d = asdict(self)
        if not d["task_args"]:
            del d["task_args"]
        if self.task not in TASKS:
            own = task_class(self.task).config_fields
            for k, default in _BUILTIN_ONLY.items():
                if k not in own and d[k] == default:
                    del d[k]
        return d

    def overrides(self) -> list[str]:
        """``key=value`` overrides (``train --set``) that rebuild this config: the task, then every field (and task
        parameter) that differs from its default, each value as a Python literal."""
        default = asdict(TrainConfig())
        items = {k: v for k, v in asdict(self).items() if k != "task_args" and (k == "task" or v != default[k])}
        return [f"{k}={v!r}" for k, v in {**items, **self.task_args}.items()]

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
        own = own_params(d.get("task", cls.task))
        unknown = set(d) - set(types_) - set(own)
        if unknown:
            raise ValueError(f"unknown config key(s) {sorted(unknown)}; known keys: {sorted(types_)}"
                             + (f"; the task's own: {', '.join(own)}" if own else ""))
        args = {k: v for k, v in d.items() if k in own}
        d = {k: _check_type(k, v, v, types_[k]) for k, v in d.items() if k not in own}
        if args:  # the task's own parameters, given by name
            d["task_args"] = {**d.get("task_args", {}), **args}
        return cls(**d)

    def hash(self) -> str:
        """SHA-256 of the canonical JSON of the fields that change results (not ``device`` or logging)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("device", "log_every")}
        if not self.task_args:  # a task without parameters of its own: runs from before task_args keep their hash
            d.pop("task_args")
        if not self.scheduled:  # the schedule's fields are off: runs from before they existed keep their hash
            for k in _SCHEDULE:
                d.pop(k)
        if self.optimizer == "adam":  # Adam, the default: runs from before the optimizer choice keep their hash
            d.pop("optimizer")
            d.pop("momentum")
        if self.board_size == 8:  # the 8x8 board: runs from before board_size existed keep their hash
            d.pop("board_size")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def own_params(task: str) -> tuple[str, ...]:
    """The parameters of its own that task ``task`` is built with: its ``config_fields`` that are no TrainConfig
    field (kept in ``task_args``)."""
    names = {f.name for f in fields(TrainConfig)}
    return tuple(f for f in task_class(task).config_fields if f not in names)


def _task_args(task: str, cls, given: dict) -> dict:
    """Every own parameter of ``task`` (class ``cls``): the ``given`` value, else its constructor's default; a
    one-line ValueError for an unknown one or one without a default."""
    own = own_params(task)
    unknown = sorted(set(given) - set(own))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} of task {task}; its own parameters (config_fields): "
                         f"{', '.join(own) or 'none'}")
    params = inspect.signature(cls).parameters if own else {}
    out = {}
    for name in own:
        if name in given:
            out[name] = given[name]
        elif name in params and params[name].default is not inspect.Parameter.empty:
            out[name] = params[name].default
        else:
            raise ValueError(f"task {task} needs its parameter {name} (--set {name}=...)")
    return out


def apply_overrides(cfg, overrides: list[str]):
    """Return ``cfg`` with ``["key=value", ...]`` applied; values are Python literals, checked against the type. A
    key that is one of the task's own parameters (:func:`own_params`) goes into ``task_args``."""
    return _overridden(type(cfg), asdict(cfg), overrides, getattr(cfg, "_split_from_task", False))


def config_from(overrides: list[str], **base) -> TrainConfig:
    """The TrainConfig of the fields ``base`` with ``["key=value", ...]`` applied (:func:`apply_overrides`), built
    once: a task of one's own is built only with its parameters set."""
    return _overridden(TrainConfig, base, overrides, False)


def _overridden(cls, base: dict, overrides: list[str], split_from_task: bool):
    types_ = typing.get_type_hints(cls)
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not of the form key=value")
        pairs.append((key.strip(), raw.strip()))
    raw_task = dict(pairs).get("task")
    task = _coerce("task", raw_task, str) if raw_task is not None else base.get("task", getattr(cls, "task", None))
    own: tuple[str, ...] = ()
    if "task_args" in types_:  # a TrainConfig: its task field has a default, so task is set
        assert task is not None
        own = own_params(task)
    changes, args = {}, {}
    for key, raw in pairs:
        if key in own:
            args[key] = _coerce(key, raw, object)
        elif key in types_:
            changes[key] = _coerce(key, raw, types_[key])
        else:
            raise ValueError(f"unknown config key {key!r}; known keys: {sorted(types_)}"
                             + (f"; the task's own: {', '.join(own)}" if own else ""))
    if "task_args" in types_:
        kept = base.get("task_args", {}) if task == base.get("task", task) else {}  # another task: not its args
        changes["task_args"] = {**kept, **args}
    if split_from_task and "split_at" not in changes:  # the task's default, for the task as now set
        changes["split_at"] = None
    return cls(**{**base, **changes})


def _coerce(key: str, raw: str, typ) -> typing.Any:
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare string such as regime=myopic
    return _check_type(key, value, raw, typ)


def _check_type(key: str, value, raw, typ):
    """``value`` if it fits the field type ``typ`` (an int where a float is expected becomes a float), else a
    ValueError naming ``key`` and the input ``raw``."""
    if typ is object:  # a task's own parameter: any literal
        return value
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
