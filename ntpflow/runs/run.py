"""The run folder: its config, task, data, weights and checkpoints. ``Run`` is the only code that names a path in it.

Run directory::

    config.json   env.json   metrics.jsonl   threads.json   init.safetensors(+.json)   model.safetensors(+.json)   DONE
    optimizer.safetensors                             (the final Adam moments or SGD momentum: model.safetensors
                                                       holds the weights alone, named as GPT.state_dict names them)
    ckpt/step_000500.safetensors + step_000500.optimizer.safetensors (+ step_000500.extras.safetensors) +
         step_000500.json                             (weights, optimizer state, the account's resume state in the
                                                       newest two only; the sidecar is written last)
    group.json         (a member of a run group: ntpflow.runs.group)
    probes/  probes_init/  probes_<step>/               (ridge probes of the final, initial or a checkpoint's weights)
    attribution/       (the replay's output: :class:`AttributionDir`)     balance/   (the balance audit's output)
"""

import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import torch

from ntpflow.files import (
    CorruptFileError,
    InFolder,
    load_tensors,
    read_json,
    resolve_device,
    save_tensors,
    sidecar,
    write_json,
)
from ntpflow.model.config import GPTConfig, split_groups
from ntpflow.model.gpt import GPT
from ntpflow.model.weights import check_tensors, shapes_of
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.data import make_datasets
from ntpflow.tasks import Batch, Task, make_task

log = logging.getLogger(__name__)
KEEP_EXTRAS = 2  # the newest checkpoints that keep their extra tensors (resume state): Checkpoints.save


@dataclass(frozen=True)
class AttributionDir:
    """The folder an attribution writes (``RUN_DIR/attribution`` by default, or ``attribute --out``); its files::

        spec.json   parts/part_*.parquet   state/step_NNNNNN.safetensors(+.json)   influence.parquet   summary.json
        matrices.safetensors(+.json)   (``--matrices``)   discover/SITE/   (``ntpflow discover``)
    """

    dir: Path

    spec = InFolder("spec.json")
    parts = InFolder("parts")
    states = InFolder("state")
    influence = InFolder("influence.parquet")
    summary = InFolder("summary.json")
    matrices = InFolder("matrices.safetensors")
    discoveries = InFolder("discover")

    def part(self, start: int) -> Path:
        """The rows of the block of steps that begins at ``start``."""
        return self.parts / f"part_{start:06d}.parquet"

    def part_files(self) -> list[Path]:
        """The written blocks of rows, in step order."""
        return sorted(self.parts.glob("part_*.parquet"))

    @property
    def done(self) -> bool:
        """Whether the attribution finished (its ``influence.parquet`` exists)."""
        return self.influence.exists()


@dataclass(frozen=True)
class AccountDir:
    """The exact account kept while training (``train --account``, ``ntpflow.runs.account``): ``RUN_DIR/account``::

        spec.json   chunks/chunk_NNNNNN.safetensors(+.json)   final.safetensors(+.json)
    """

    dir: Path

    spec = InFolder("spec.json")
    chunks = InFolder("chunks")
    final = InFolder("final.safetensors")

    def chunk(self, first: int) -> Path:
        """The accumulators of the chunk of steps that begins at ``first``."""
        return self.chunks / f"chunk_{first:06d}.safetensors"

    def chunk_files(self) -> list[Path]:
        """The finished chunks (their sidecar written), in step order."""
        return sorted(p.with_suffix(".safetensors") for p in self.chunks.glob("chunk_*.json"))


class RunPaths:
    """The paths inside a run folder, the only place they are spelled (the folder may not hold a run yet).
    ``RunPaths(dir)``; every :class:`Run` has them."""

    dir: Path

    def __init__(self, dir: str | Path):
        self.dir = Path(dir)

    config_path = InFolder("config.json")
    env_path = InFolder("env.json")
    metrics_path = InFolder("metrics.jsonl")
    threads_path = InFolder("threads.json")
    done_path = InFolder("DONE")
    group_path = InFolder("group.json")
    ckpt_dir = InFolder("ckpt")
    sweep_path = InFolder("sweep.json")  # the sweep's record of a run it prepared (ntpflow.runs.sweep)
    failed_path = InFolder("FAILED")  # the sweep's record of a run that failed every attempt

    def probes_dir(self, which: str | int = "final") -> Path:
        """Folder of the probes of weights ``which``: ``probes`` (final) or ``probes_<which>`` (``init``, a step)."""
        return self.dir / ("probes" if str(which) == "final" else f"probes_{which}")

    def classifier_path(self, which: str | int = "final") -> Path:
        """Othello's per-square classifier probes of weights ``which`` (``experiments.othello_probes``)."""
        return self.dir / f"classifier_{which}.safetensors"

    def attribution(self, out: str | Path | None = None) -> AttributionDir:
        """The attribution folder ``out`` (default ``RUN_DIR/attribution``)."""
        return AttributionDir(Path(out) if out is not None else self.dir / "attribution")

    @property
    def account(self) -> AccountDir:
        """The exact account kept while training (``train --account``)."""
        return AccountDir(self.dir / "account")

    def attributions(self) -> list[Path]:
        """Every attribution folder inside the run folder (``attribution*``)."""
        return sorted(p for p in self.dir.glob("attribution*") if p.is_dir())

    def balance_dir(self, out: str | Path | None = None) -> Path:
        """The balance audit's folder ``out`` (default ``RUN_DIR/balance``)."""
        return Path(out) if out is not None else self.dir / "balance"


def run_name(run_dir: str | Path) -> str:
    """A run's name in log lines (:attr:`Run.name`): its folder's name, with the folder above for one named ``run``."""
    run_dir = Path(run_dir)
    return f"{run_dir.parent.name}/{run_dir.name}" if run_dir.name == "run" else run_dir.name


def model_config(cfg: TrainConfig, task: Task) -> GPTConfig:
    """The GPTConfig of a training config: the regime sets ``myopic`` and ``position_groups``."""
    T = task.seq_len
    groups = None
    if cfg.untied:
        assert cfg.split_at is not None  # TrainConfig resolves it for an untied regime
        groups = "untied" if cfg.split_at == 0 else split_groups(T, cfg.split_at)
    return GPTConfig(vocab_size=len(task.vocab), n_ctx=T, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     d_model=cfg.d_model, myopic=cfg.myopic, position_groups=groups)


def task_for(cfg: TrainConfig) -> Task:
    """The task of a config; a task class lists in ``config_fields`` the TrainConfig fields it is built with, and its
    own parameters, which the config holds in ``task_args``."""
    return make_task(cfg.task, **cfg.task_kwargs())


def optimizer_path(path: Path) -> Path:
    """The file beside a weights file ``path`` that holds the optimizer state saved with it (and, in versions before
    :func:`extras_path`, the extra tensors): ``model.safetensors`` -> ``optimizer.safetensors``,
    ``step_000500.safetensors`` -> ``step_000500.optimizer.safetensors``."""
    return _beside(path, "optimizer")


def extras_path(path: Path) -> Path:
    """The file beside a weights file ``path`` that holds the extra tensors saved with it (a stepper's or a replay's
    resume state): ``step_000500.safetensors`` -> ``step_000500.extras.safetensors``."""
    return _beside(path, "extras")


def _beside(path: Path, kind: str) -> Path:
    path = Path(path)
    return path.with_name(f"{kind}.safetensors" if path.name == "model.safetensors"
                          else f"{path.stem}.{kind}.safetensors")


def model_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors of a weights file, by parameter name: a file of this version holds them alone, one of
    older versions (model, optimizer and extras in one file) as ``model.<name>``."""
    if any(k.startswith("model.") for k in tensors):
        return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    return tensors


def save_state(path: Path, model: GPT, opt: torch.optim.Optimizer, meta: dict,
               extra: dict[str, torch.Tensor] | None = None) -> None:
    """Save the model's weights to ``path`` (alone, by parameter name: a file ``GPT.load_state_dict`` takes), the
    optimizer state to :func:`optimizer_path` and the ``extra`` tensors to :func:`extras_path` beside it, with a JSON
    sidecar of ``path`` holding ``meta``: Adam's step (``adam_step``), whether SGD's momentum buffers exist yet
    (``momentum``) and the SHA-256 of the optimizer and extras files (``optimizer_sha256``, ``extras_sha256``). The
    other files are written first, the sidecar last."""
    rest: dict[str, torch.Tensor] = {}
    adam_step, momentum = 0, False
    for name, p in zip([n for n, _ in model.named_parameters()], opt.param_groups[0]["params"]):
        st = opt.state.get(p)
        if st and "exp_avg" in st:
            rest[f"adam.exp_avg.{name}"], rest[f"adam.exp_avg_sq.{name}"] = st["exp_avg"], st["exp_avg_sq"]
            adam_step = int(st["step"])
        elif st and st.get("momentum_buffer") is not None:
            rest[f"sgd.momentum_buffer.{name}"], momentum = st["momentum_buffer"], True
    meta = {**meta, "adam_step": adam_step, **({"momentum": True} if momentum else {})}
    if rest:
        meta["optimizer_sha256"] = save_tensors(optimizer_path(path), rest)
    if extra:
        meta["extras_sha256"] = save_tensors(extras_path(path), extra)
    save_tensors(path, model.state_dict(), meta)


def read_state(path: Path, device) -> tuple[dict, dict[str, torch.Tensor]]:
    """What ``save_state`` wrote, checked against its checksums: (meta, all tensors on ``device``, the model's as
    ``model.<name>``, the optimizer's as ``adam.*`` or ``sgd.*``, and the extras, if the checkpoint still has them:
    see ``Checkpoints.save``). Reads files of older versions too (one file of all; the extras in the optimizer's)."""
    tensors = load_tensors(path, device)
    meta = read_json(sidecar(path))
    if any(k.startswith("model.") for k in tensors):  # an older version's single file
        return meta, tensors
    tensors = {f"model.{k}": v for k, v in tensors.items()}
    if "optimizer_sha256" in meta:
        tensors |= load_tensors(optimizer_path(path), device, sha256=meta["optimizer_sha256"])
    if "extras_sha256" in meta:
        tensors |= load_tensors(extras_path(path), device, sha256=meta["extras_sha256"])
    return meta, tensors




def apply_state(model: GPT, opt: torch.optim.Optimizer, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Restore a state read by :func:`read_state` into ``model`` and ``opt`` (``load_latest`` reads every member's
    first, then restores them)."""
    model.load_state_dict(model_tensors(tensors))
    if meta.get("momentum"):
        sd = opt.state_dict()
        names = [n for n, _ in model.named_parameters()]
        sd["state"] = {i: {"momentum_buffer": tensors[f"sgd.momentum_buffer.{n}"]} for i, n in enumerate(names)}
        opt.load_state_dict(sd)
    if meta["adam_step"]:
        sd = opt.state_dict()
        names = [n for n, _ in model.named_parameters()]
        sd["state"] = {i: {"step": torch.tensor(float(meta["adam_step"])),
                           "exp_avg": tensors[f"adam.exp_avg.{n}"],
                           "exp_avg_sq": tensors[f"adam.exp_avg_sq.{n}"]} for i, n in enumerate(names)}
        opt.load_state_dict(sd)
    if "steps_taken" in opt.param_groups[0]:  # an optimizer that counts its steps itself (training.ScheduledSGD)
        sd = opt.state_dict()
        for group in sd["param_groups"]:
            group["steps_taken"] = int(meta["step"])
        opt.load_state_dict(sd)


class Checkpoints:
    """A folder of checkpoints ``step_NNNNNN.safetensors`` + ``step_NNNNNN.optimizer.safetensors`` (+
    ``step_NNNNNN.extras.safetensors``) + ``step_NNNNNN.json``: weights, optimizer state and any extra tensors of one
    step (:func:`save_state`). The sidecar is written last, so a checkpoint counts once its sidecar exists; a kill
    before it leaves tensors without a sidecar, which are never read. A run's ``ckpt/`` and a replay's resume points
    (``state/``) are such folders. The extras are resume state (the account's running chunk, a replay's tracker), so
    only the newest :data:`KEEP_EXTRAS` checkpoints keep them: an account with per-type rows would otherwise copy its
    running accumulators (tens of MB at d 128) into every checkpoint."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, step: int) -> Path:
        """The tensors file of ``step``'s checkpoint."""
        return self.folder / f"step_{step:06d}.safetensors"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (those whose sidecar exists), ascending."""
        return sorted(_step_of(p) for p in self.folder.glob("step_*.json"))

    def save(self, step: int, model: GPT, opt: torch.optim.Optimizer, meta: dict | None = None,
             extra: dict[str, torch.Tensor] | None = None) -> None:
        """Save ``step``'s checkpoint: model, Adam and ``extra`` tensors; ``{"step": step, **meta}`` in the sidecar.
        Then the older checkpoints but the newest :data:`KEEP_EXTRAS` lose their extras."""
        self.folder.mkdir(parents=True, exist_ok=True)
        sidecar(self.path(step)).unlink(missing_ok=True)  # rewriting a checkpoint: it counts again once complete
        save_state(self.path(step), model, opt, {"step": step, **(meta or {})}, extra)
        self.drop_extras(keep=KEEP_EXTRAS)

    def drop_extras(self, keep: int) -> None:
        """Remove the extras of every complete checkpoint but the newest ``keep`` (their sidecars first, so a kill in
        between leaves an unread file, removed next time); a checkpoint without them resumes no stepper state."""
        kept = set(self.steps()[-keep:])
        for p in self.folder.glob("step_*.extras.safetensors"):
            step = _step_of(p)
            if step in kept:
                continue
            side = sidecar(self.path(step))
            meta = read_json(side) if side.exists() else {}
            if "extras_sha256" in meta:
                del meta["extras_sha256"]
                write_json(side, meta)
            p.unlink(missing_ok=True)

    def load_latest(self, model: GPT, opt: torch.optim.Optimizer, device,
                    upto: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Load the newest checkpoint (at or before step ``upto``) that verifies into ``model`` and ``opt``: (its
        step, all its tensors), or (0, {}) when there is none (see :func:`load_latest`)."""
        step, tensors = load_latest([self], [model], [opt], device, upto)
        return step, tensors[0] if step else {}

    def prune(self, keep: int = 2) -> None:
        """Remove every checkpoint but the newest ``keep`` complete ones (torn writes included)."""
        kept = set(self.steps()[-keep:])
        for p in self.folder.glob("step_*"):
            if _step_of(p) not in kept:
                if p.is_dir():  # a resume point of older versions (a folder per step)
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def _step_of(path: Path) -> int:
    """The step of a checkpoint file ``step_NNNNNN.*``."""
    return int(path.name.split("_")[1].split(".")[0])


def load_latest(folders: Sequence[Checkpoints], models: Sequence[GPT], opts: Sequence[torch.optim.Optimizer], device,
                upto: int | None = None) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """Resume runs (one, or the members of a group) from their newest common checkpoint at or before ``upto`` whose
    files all verify: load member r's from ``folders[r]`` into ``models[r]`` and ``opts[r]``; returns (its step, each
    member's tensors), or (0, []) when there is none. A corrupt checkpoint (checksum mismatch, truncated, missing
    tensors) is skipped with a warning, falling back to the one before; the models are only changed once every
    member's checkpoint of a step has been read."""
    common = set.intersection(*(set(f.steps()) for f in folders))
    for step in sorted((s for s in common if upto is None or s <= upto), reverse=True):
        try:
            states = [read_state(f.path(step), device) for f in folders]
        except (CorruptFileError, FileNotFoundError) as e:  # rotten, or its tensors deleted
            log.warning("warning: %s; falling back to the previous checkpoint", e)
            continue
        for (meta, tensors), model, opt in zip(states, models, opts):
            apply_state(model, opt, meta, tensors)
        return step, [tensors for _, tensors in states]
    return 0, []


@dataclass
class Run(RunPaths):
    """A run directory: its config, task, data and weights. ``Run.open(dir)`` reads an existing one.

    The datasets and the initial and final weights are built or read once per ``Run`` and kept (on the CPU): one
    command that probes, replays and checks a run builds its data once and reads each weights file once.
    """

    dir: Path
    cfg: TrainConfig
    _weights: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.dir = Path(self.dir)

    @classmethod
    def open(cls, run_dir: str | Path) -> "Run":
        """Read the existing run directory ``run_dir`` (its ``config.json``); FileNotFoundError if it is not one."""
        run_dir = Path(run_dir)
        path = run_dir / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json)")
        d = read_json(path)
        if not isinstance(d, dict) or not isinstance(d.get("train"), dict):
            raise ValueError(f"{path} is not an ntpflow run config (no 'train' settings)")
        try:
            return cls(run_dir, TrainConfig.from_dict(d["train"]))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    @property
    def name(self) -> str:
        """The run's name in log lines: its folder's name, with the folder above for a folder named ``run`` (as an
        experiment's ``OUT/run`` and ``OUT/myopic/run``), so that runs logging side by side stay apart."""
        return run_name(self.dir)

    @cached_property
    def task(self) -> Task:
        """The run's task (built once)."""
        return task_for(self.cfg)

    @property
    def done(self) -> bool:
        """Whether training finished (the ``DONE`` marker exists)."""
        return self.done_path.exists()

    def final_record(self) -> dict:
        """What ``DONE`` records: the final step and the final evaluation."""
        return read_json(self.done_path)

    @property
    def in_group(self) -> bool:
        """Whether the run was trained as a member of a run group (``group.json`` exists)."""
        return self.group_path.exists()

    def group_record(self) -> dict:
        """``group.json``: {"index": r, "members": [config dicts], "dirs": [member dirs relative to this one]}."""
        return read_json(self.group_path)

    def model_config(self) -> GPTConfig:
        """The run's GPTConfig (see :func:`model_config`)."""
        return model_config(self.cfg, self.task)

    @cached_property
    def _datasets(self) -> tuple[Batch, Batch]:
        return make_datasets(self.cfg, self.task)

    def datasets(self) -> tuple[Batch, Batch]:
        """The run's (train, eval) sets (``ntpflow.runs.data.make_datasets``), built once per Run."""
        return self._datasets

    def weights(self, which: str | int = "final") -> dict[str, torch.Tensor]:
        """The model tensors of weights ``"final"``, ``"init"`` or a checkpoint step, by parameter name, on the CPU;
        ``"init"`` and ``"final"`` of a finished run are read once per Run (do not modify them)."""
        key = str(which)
        if key in self._weights:
            return self._weights[key]
        path = self.weights_path(which)
        if key not in ("final", "init") and not path.exists():
            raise FileNotFoundError(f"missing checkpoint {path}; {self.name} has weights {self.weights_available()}")
        state = model_tensors(load_tensors(path))
        if key == "init" or key == "final" and self.done:
            self._weights[key] = state
        return state

    def load_model(self, which: str | int = "final", device: str | torch.device = "cpu", **overrides) -> GPT:
        """Load weights ``"final"``, ``"init"`` or a step number (a checkpoint) into a new GPT; ``overrides`` go to
        its GPTConfig (e.g. ``myopic``). A file whose tensors do not match the model's (names, shapes, dtype) is a
        one-line ValueError naming the first bad tensor."""
        path = self.weights_path(which)
        model = GPT(replace(self.model_config(), **overrides))
        state = self.weights(which)
        check_tensors(shapes_of(model), state, f"checkpoint {path} does not match the run's model")
        model.load_state_dict(state)
        return model.to(resolve_device(device) if isinstance(device, str) else device)

    def export(self, path: str | Path, which: str | int = "final") -> Path:
        """Write weights ``which`` as a ``transformers`` GPT-2 folder (``GPT.save_pretrained``: weights and
        ``config.json``, no optimizer state) at ``path``; returns it. One position group only (not an untied run)."""
        self.load_model(which).save_pretrained(path)
        return Path(path)

    def weights_path(self, which: str | int) -> Path:
        """File holding the weights ``"final"``, ``"init"`` or a checkpoint step."""
        if str(which) in ("final", "init"):
            return self.dir / ("model.safetensors" if str(which) == "final" else "init.safetensors")
        try:
            return self.ckpts.path(int(which))
        except ValueError:
            raise ValueError(f"unknown weights {which!r}; use 'final', 'init' or a checkpoint step") from None

    def weights_available(self) -> str:
        """The weights one can load, as a line: ``final, init, checkpoint steps 4, 8, 12``."""
        have = [w for w in ("final", "init") if self.weights_path(w).exists()]
        steps = self.checkpoints()
        have.append(f"checkpoint steps {', '.join(map(str, steps))}" if steps else "no checkpoints")
        return ", ".join(have)

    @cached_property
    def ckpts(self) -> Checkpoints:
        """The run's training checkpoints (``ckpt/``)."""
        return Checkpoints(self.ckpt_dir)

    def checkpoints(self) -> list[int]:
        """Steps of the complete checkpoints (those whose JSON sidecar exists), ascending."""
        return self.ckpts.steps()

    def metrics(self) -> list[dict]:
        """The records of ``metrics.jsonl`` in order ([] if there is none)."""
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []

    @property
    def summary(self) -> dict:
        """The run as results: its config, its final evaluation (``DONE``; empty while unfinished) and checkpoints."""
        return {"config": self.cfg.to_dict(), "final": self.final_record() if self.done else {},
                "checkpoints": self.checkpoints()}

    @property
    def rows(self):
        """``metrics.jsonl`` as a pandas DataFrame (step, kind "train"/"eval", loss, eval_loss, ...; needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Run.rows needs pandas (pip install pandas); Run.metrics() gives the same records "
                              "as dicts") from None
        return pd.DataFrame(self.metrics())

    def plot(self):
        """A matplotlib Figure of the training loss and the eval loss over the steps (needs matplotlib)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5, 3), layout="constrained")
        ax = fig.subplots()
        for kind, key in (("train", "loss"), ("eval", "eval_loss")):
            pts = [(m["step"], m[key]) for m in self.metrics() if m["kind"] == kind and key in m]
            if pts:
                ax.plot(*zip(*pts), label=f"{kind} loss", marker="o" if kind == "eval" else None, ms=3)
        ax.set_xlabel("training step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(self.name)
        ax.legend()
        return fig

