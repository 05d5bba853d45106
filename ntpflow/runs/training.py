"""The training loop: one deterministic, resumable cadence for every task and regime, shared by a run trained alone
(:func:`train`) and a run group (``ntpflow.runs.group.train_group``), and the run directory it writes.

Run directory::

    config.json   env.json   metrics.jsonl   init.safetensors(+.json)   model.safetensors(+.json)   DONE
    optimizer.safetensors                              (the final optimizer state; model.safetensors: weights only)
    ckpt/step_000500.safetensors + step_000500.optimizer.safetensors + step_000500.json   (the sidecar last)

The same config gives bit-identical weights; a killed run resumes from its last checkpoint to the same result.
Training the same config with more ``steps`` into the directory extends the run, to the same bits as a run trained
that long from the start.
"""

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ntpflow.files import (
    DirLock,
    atomic_write,
    ensure_writable_dir,
    environment,
    fault_point,
    read_json,
    resolve_device,
    save_tensors,
    sidecar,
    write_json,
)
from ntpflow.model.gpt import GPT
from ntpflow.model.loss import lm_loss
from ntpflow.progress import progress_of
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.data import DataOrder, check_task, make_datasets, to_torch
from ntpflow.runs.metrics import MetricsLog, check_sinks, make_sinks
from ntpflow.runs.run import Run, load_latest, optimizer_path, save_state
from ntpflow.runs.threads import continue_threads, kept_threads
from ntpflow.runs.workers import barrier, check_same_weights, join_workers, same_threads, worker_env
from ntpflow.tasks import Task

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or the weights became non-finite (NaN or inf): training stopped before saving them."""


@torch.no_grad()
def evaluate(model: GPT, data: dict[str, torch.Tensor], task: Task, chunk: int = 2048) -> dict[str, float]:
    """Eval loss, and where ``data`` has a legal mask: legal-output accuracy and first-output accuracy.

    ``legal_acc`` is, per sequence, the share of counted output predictions (``loss_mask`` true, positions
    ``first_output_pos .. T-2``) whose argmax is legal, averaged over sequences; ``first_acc`` is that of the first.
    """
    was_training = model.training
    model.eval()
    n = len(data["tokens"])
    p0, T = task.first_output_pos, task.seq_len
    loss_sum, legal_hits, first_hits = 0.0, 0.0, 0.0
    for s in range(0, n, chunk):
        tok, mask = data["tokens"][s:s + chunk], data["loss_mask"][s:s + chunk]
        logits = model(tok)
        loss_sum += lm_loss(logits, tok, mask).item() * len(tok)
        if "legal" in data:
            pred = logits[:, p0:T - 1].argmax(-1)  # predictions of the output tokens
            ok = data["legal"][s:s + chunk, p0:T - 1].gather(-1, pred.unsqueeze(-1)).squeeze(-1)
            counted = mask[:, p0:T - 1]
            ok = ok & counted
            legal_hits += (ok.double().sum(1) / counted.double().sum(1).clamp(min=1)).sum().item()
            first_hits += ok[:, 0].double().sum().item()
    model.train(was_training)
    out = {"eval_loss": loss_sum / n}
    if "legal" in data:
        out.update(legal_acc=legal_hits / n, first_acc=first_hits / n)
    return out


def prepare_run_dir(run: Run, *, extend: bool = False) -> None:
    """Create the run dir of ``run`` (its config ``run.cfg``), or check that an existing one holds the same config
    (never overwrite another run). A run that differs only in having fewer ``steps`` is extended to ``run.cfg.steps``
    (with ``extend``; without it, only checked). Every setting is checked before anything is written."""
    cfg = run.cfg
    resolve_device(cfg.device)  # a bad or unavailable device fails here, not after the first files exist
    if run.config_path.exists():
        old = Run.open(run.dir).cfg
        if old.hash() != cfg.hash():
            diff = [k for k, v in cfg.to_dict().items()
                    if old.to_dict().get(k) != v and k not in ("device", "log_every")]
            if diff == ["steps"] and cfg.steps > old.steps:
                _check_extension(Run(run.dir, old))
                if extend:
                    _extend(Run(run.dir, old), cfg)
                return
            raise ValueError(f"{run.dir} holds a run with a different config (differs in: {', '.join(diff)}); "
                             "choose another output directory")
        return
    task = run.task
    check_task(cfg, task)  # a task of one's own: its first batch (a file task: its size), before anything is written
    model = run.model_config().to_dict()  # validates before anything is written
    ensure_writable_dir(run.dir)
    run.ckpt_dir.mkdir(exist_ok=True)
    write_json(run.config_path, {"train": cfg.to_dict(), "model": model, "config_hash": cfg.hash()})
    write_json(run.env_path, environment())
    task.save_artifacts(run.dir)  # e.g. the stories task's tokenizer


def train(cfg: TrainConfig, run_dir: str | Path, *, progress: bool = True, track: Sequence = (),
          force_unlock: bool = False, threads: int | None = None, account: "AccountLike | None" = None) -> Run:
    """Train ``cfg`` into ``run_dir``, resuming from its last good checkpoint if one exists. Returns the Run.

    Metrics go to ``run_dir/metrics.jsonl`` and to the optional ``track`` sinks (``ntpflow.runs.metrics``).
    ``force_unlock`` takes over a lock left by a process on another host (see :class:`~ntpflow.files.DirLock`).
    ``threads``: torch threads on a CPU. ``None`` resumes a run with the count it trained with, so an interrupted
    run ends in the same bits, and starts a fresh one with this process's count (``ntpflow.runs.threads``); the
    caller's count is restored on return.
    A loss or weights becoming non-finite raise :class:`TrainingDiverged` (the checkpoints before stay; no DONE).
    ``account`` (an ``ntpflow.runs.account.AccountSpec``): keep the exact account at its sites while training
    (``RUN_DIR/account``; the weights are the same bits as without it). Started as one of several workers
    (``ntpflow.runs.workers``: torchrun, or ``train --workers``), the workers share the account's readout and worker 0
    writes the folder.

    Loss: ``lm_loss`` (mean over positions of the per-position batch-mean cross-entropy). Optimiser: Adam,
    no weight decay; or SGD with momentum (``cfg.optimizer``); a constant learning rate, or the schedule of
    ``cfg.warmup``/``cfg.decay`` (:func:`make_optimizer`).
    """
    run = Run(Path(run_dir), cfg)
    check_sinks(track)  # missing packages or credentials fail before anything is written
    workers = worker_env()
    if workers is not None and account is None:
        raise ValueError("several workers train with the account only (--account SITES): they split the batch and "
                         "the account's readout")
    if account is not None:
        account.check(run)  # bad sites or sizes fail before anything is written
    if account is not None and workers is not None and join_workers(cfg.device) != 0:  # beside worker 0, which writes
        barrier()  # worker 0 has prepared the folder
        if not run.done:
            fit([run], account.stepper, progress=False, track=(), threads=threads, lead=False)
        return run
    prepare_run_dir(run)
    with DirLock(run.dir, force=force_unlock), kept_threads():  # one writer per run directory
        if account is not None:
            account.check(run)  # again under the lock, before any extension
        prepare_run_dir(run, extend=True)  # again under the lock: another process may have created it
        if account is not None:
            account.prepare(run)
        barrier()  # the other workers, if any, may read the folder now
        if run.done:
            log.info("%s is already finished", run.dir)
        else:
            fit([run], Alone if account is None else account.stepper, progress=progress, track=track,
                threads=threads)
    return run


def _check_extension(run: Run) -> None:
    """Refuse to extend a run whose final weights have been replayed: the attribution would describe other weights;
    or one with a learning-rate schedule, whose rates depend on the number of steps."""
    if run.cfg.scheduled:
        raise ValueError(f"{run.dir} follows a learning-rate schedule over its {run.cfg.steps} steps; a longer run "
                         "has other rates, so it cannot be extended: train it into another directory")
    taken = [p.name for p in run.attributions()]
    if taken:
        raise ValueError(f"{run.dir} has an attribution of its {run.cfg.steps}-step weights ({', '.join(taken)}); "
                         "move it away before training the run further")


def _extend(run: Run, cfg: TrainConfig) -> None:
    """Turn the finished (or unfinished) ``run`` into a run of ``cfg.steps`` steps that resumes where it stopped.

    A run without a schedule (one with a schedule is refused) has no step-dependent setting, so steps 0..T of a longer run are exactly the shorter run: its final state becomes
    the checkpoint ``ckpt/step_T`` and its final probes ``probes_T``. Every intermediate state of this function is
    a valid run directory (a kill leaves the old run, unfinished, or the new one), so rerunning completes it."""
    old_steps = run.cfg.steps
    log.info("extending %s from %d to %d steps", run.dir, old_steps, cfg.steps)
    run.done_path.unlink(missing_ok=True)
    final = run.weights_path("final")
    if final.exists():  # the tensors first: a checkpoint counts once its sidecar is there
        ckpt = run.weights_path(old_steps)
        if optimizer_path(final).exists():
            optimizer_path(final).replace(optimizer_path(ckpt))
        final.replace(ckpt)
        sidecar(final).replace(sidecar(ckpt))
    if run.probes_dir("final").exists():
        run.probes_dir("final").replace(run.probes_dir(old_steps))
    fault_point("extend:before_config")
    env = read_json(run.env_path)
    env.setdefault("extensions", []).append({"from_steps": old_steps, "to_steps": cfg.steps, **environment()})
    write_json(run.env_path, env)
    config = read_json(run.config_path)
    write_json(run.config_path, {**config, "train": cfg.to_dict(), "config_hash": cfg.hash()})


class Stepper(Protocol):
    """How the members of a training take their steps: one run alone (:class:`Alone`) or a run group stepping as one
    batched model (``ntpflow.runs.group.Stacked``). Built as ``Stepper(runs, models, opts, device)`` from each
    member's model and Adam, resumed."""

    evals: list[dict[str, torch.Tensor]]  # each member's eval set on the device

    def step(self, step: int) -> torch.Tensor:
        """Take training step ``step`` of every member; returns their losses [R] (no sync)."""
        ...

    def members(self) -> list[tuple[GPT, torch.optim.Optimizer]]:
        """Each member's model and optimizer, holding its current state."""
        ...

    def weights_finite(self) -> torch.Tensor:
        """Whether each member's weights are all finite [R] (no sync)."""
        ...

    def resume(self, start: int, states: list[dict[str, torch.Tensor]]) -> None:
        """Restore what :meth:`extra_state` saved with the checkpoint of step ``start`` (each member's tensors)."""
        ...

    def extra_state(self) -> list[dict[str, torch.Tensor]]:
        """Each member's extra tensors saved with a checkpoint."""
        ...

    def finish(self) -> None:
        """Write what the stepper keeps besides the weights, after the final weights and before ``DONE``."""
        ...


class AccountLike(Protocol):
    """What ``train`` needs of an account to keep while training (``ntpflow.runs.account.AccountSpec``)."""

    def check(self, run: Run) -> None:
        """ValueError (one line) unless ``run`` can be trained with it."""
        ...

    def prepare(self, run: Run) -> None:
        """Create its folder in the run."""
        ...

    @property
    def stepper(self) -> Callable[..., Stepper]:
        """The training's stepper."""
        ...


class PlainSteps:
    """A stepper that keeps nothing besides the weights (the no-op :class:`Stepper` hooks)."""

    def members(self) -> list[tuple[GPT, torch.optim.Optimizer]]:
        raise NotImplementedError

    def resume(self, start: int, states: list[dict[str, torch.Tensor]]) -> None:
        pass

    def extra_state(self) -> list[dict[str, torch.Tensor]]:
        return [{} for _ in self.members()]

    def finish(self) -> None:
        pass


class Alone(PlainSteps):
    """One run trained alone (:class:`Stepper`): :func:`train_step` on its own batch, so a run keeps its bits."""

    def __init__(self, runs: Sequence[Run], models: Sequence[GPT], opts: Sequence[torch.optim.Optimizer], device):
        (run,), (self.model,), (self.opt,) = runs, models, opts
        train_set, self.eval_set = make_datasets(run.cfg, run.task)  # not cached on the Run, which train() returns
        self.data, self.evals = to_torch(train_set, device), [to_torch(self.eval_set, device)]
        self.order, self.device = DataOrder(run.cfg.seed, run.cfg.n_train, run.cfg.batch_size), device

    def step(self, step: int) -> torch.Tensor:
        idx = self.order(step).to(self.device)
        return train_step(self.model, self.opt, self.data["tokens"][idx], self.data["loss_mask"][idx]).detach()[None]

    def members(self) -> list[tuple[GPT, torch.optim.Optimizer]]:
        return [(self.model, self.opt)]

    def weights_finite(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all()[None]


def init_members(runs: Sequence[Run], device) -> tuple[list[GPT], list[torch.optim.Optimizer]]:
    """Each run's model at its seed's initial weights on ``device`` (training mode), and its fresh Adam."""
    mcfg = runs[0].model_config()
    models = [GPT(mcfg, seed=run.cfg.seed).to(device).train() for run in runs]
    return models, [make_optimizer(m, run.cfg) for m, run in zip(models, runs)]


def fit(runs: Sequence[Run], stepper: Callable[..., Stepper], *, progress: bool = True, track: Sequence = (),
        threads: int | None = None, lead: bool = True) -> None:
    """Train the prepared, unfinished ``runs`` (one run, or the members of a group: one regime, one schedule) to
    their ``steps`` with ``stepper``, resuming from their newest common checkpoint that verifies; ``track`` and
    ``threads`` as in :func:`train`. Writes each member's ``init`` weights (once), metrics, checkpoints, final
    weights and, last, ``DONE`` (see :func:`_loop`). ``lead=False``: a worker beside worker 0, which computes the
    same steps and writes nothing (``ntpflow.runs.workers``)."""
    cfg = runs[0].cfg
    device = resolve_device(cfg.device)
    models, opts = init_members(runs, device)
    for run, model in zip(runs, models):
        if lead and not sidecar(run.weights_path("init")).exists():
            save_tensors(run.weights_path("init"), {f"model.{k}": v for k, v in model.state_dict().items()},
                         {"step": 0, "config_hash": run.cfg.hash()})
    start, states = load_latest([run.ckpts for run in runs], models, opts, device, cfg.steps)
    if start:
        log.info("resuming %s from step %d", ", ".join(str(run.dir) for run in runs), start)
    if lead:
        continue_threads([run.dir for run in runs], start, device, threads)
    same_threads()  # the workers on worker 0's count
    steps = stepper(runs, models, opts, device)
    steps.resume(start, states)
    _loop(runs, steps, start, device, progress, track, lead)


def _loop(runs: Sequence[Run], stepper: Stepper, start: int, device, progress: bool, track: Sequence,
          lead: bool = True) -> None:
    """The training cadence of one run or a group, from step ``start``: evaluate every ``eval_every`` steps (at the
    step's start), log the train losses every ``log_every`` steps, checkpoint every ``ckpt_every`` steps; the losses
    are checked finite without a sync, and with the weights before each log and checkpoint (:class:`TrainingDiverged`,
    nothing of that step saved). At the end: the final evaluation, the final weights, and ``DONE`` last (a member is
    finished only once every member is saved). ``lead=False``: compute the same and write nothing."""
    cfg = runs[0].cfg
    for run in runs if lead else ():
        _truncate_metrics(run.metrics_path, start)
    logs = [MetricsLog(run.metrics_path, make_sinks(track, run.dir, run.cfg.to_dict())) for run in runs if lead]
    try:
        desc = runs[0].name if len(runs) == 1 else f"group of {len(runs)}: {runs[0].name}"
        bar = progress_of(range(start, cfg.steps), initial=start, total=cfg.steps, enabled=progress, desc=desc)
        finite = torch.ones(len(runs), dtype=torch.bool, device=device)  # each member's losses so far (no sync)
        checked = start  # the last step known good
        for step in bar:
            if step % cfg.eval_every == 0 and lead:
                for lg, ev in zip(logs, _evaluate(stepper, runs, step)):
                    lg.log({"step": step, "kind": "eval", **ev})
            losses = stepper.step(step)
            finite &= torch.isfinite(losses)
            done, save = step + 1, (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.steps
            if done % cfg.log_every == 0 or save:
                checked = _check_finite(finite, stepper, runs, checked, done)
            if done % cfg.log_every == 0:
                values = losses.tolist()
                for lg, loss in zip(logs, values):
                    lg.log({"step": done, "kind": "train", "loss": loss})
                bar.set_postfix(loss=f"{sum(values) / len(values):.4f}")
            if save:
                for lg in logs:
                    lg.flush()
                extras = stepper.extra_state()  # every worker: the account's parts are gathered
                check_same_weights([m for m, _ in stepper.members()], done)
                for run, (model, opt), extra in zip(runs if lead else (), stepper.members(), extras):
                    run.ckpts.save(done, model, opt, {"config_hash": run.cfg.hash()}, extra)
                fault_point("train:after_checkpoint")
        _check_finite(finite, stepper, runs, checked, cfg.steps)
        check_same_weights([m for m, _ in stepper.members()], cfg.steps)
        finals = _evaluate(stepper, runs, cfg.steps) if lead else []
        for lg, final in zip(logs, finals):
            lg.log({"step": cfg.steps, "kind": "eval", **final})
    finally:
        for lg in logs:
            lg.close()
    for run, (model, opt) in zip(runs if lead else (), stepper.members()):
        save_state(run.weights_path("final"), model, opt, {"step": cfg.steps, "config_hash": run.cfg.hash()})
    stepper.finish()  # every worker (the account's last chunk is gathered); worker 0 writes
    for run, final in zip(runs, finals):  # DONE last
        write_json(run.done_path, {"step": cfg.steps, **final})


def _check_finite(finite: torch.Tensor, stepper: Stepper, runs: Sequence[Run], good: int, step: int) -> int:
    """Raise :class:`TrainingDiverged` if a member's loss since step ``good`` (``finite`` [R]: all its losses so far)
    or its weights are non-finite; else return ``step``."""
    ok = finite & stepper.weights_finite()
    if bool(ok.all()):
        return step
    cfg, bad = runs[0].cfg, [str(run.dir) for run, fine in zip(runs, ok.tolist()) if not fine]
    last = sorted(set.intersection(*(set(run.checkpoints()) for run in runs)))
    raise TrainingDiverged(f"training of {', '.join(bad)} diverged: the loss or the weights became non-finite between "
                           f"steps {good} and {step} (lr={cfg.lr:g}, "
                           + (f"beta1={cfg.beta1:g}, beta2={cfg.beta2:g}); " if cfg.optimizer == "adam"
                              else f"SGD, momentum={cfg.momentum:g}); ")
                           + (f"its last good checkpoint is step {last[-1]}" if last else "no checkpoint was saved")
                           + ("; the group stops" if len(runs) > 1 else "") + "; no DONE written")


def _evaluate(stepper: Stepper, runs: Sequence[Run], step: int) -> list[dict]:
    """Each member's :func:`evaluate` at ``step``, refusing a non-finite eval loss (:class:`TrainingDiverged`)."""
    task, out = runs[0].task, []
    for run, (model, _), data in zip(runs, stepper.members(), stepper.evals):
        ev = evaluate(model, data, task)
        if not np.isfinite(ev["eval_loss"]):
            raise TrainingDiverged(f"training of {run.dir} diverged: the eval loss at step {step} is non-finite "
                                   f"({ev['eval_loss']}, lr={run.cfg.lr:g}); no DONE written")
        out.append(ev)
    return out


def train_step(model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One optimizer step on ``lm_loss``; training and its replay both call this, so they agree bit for bit."""
    loss = lm_loss(model(tokens), tokens, loss_mask)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam without weight decay; the fused kernel on CPU and CUDA (one pass over an untied model's many copies).
    ``cfg.optimizer == "sgd"``: SGD with ``cfg.momentum`` (no dampening, no Nesterov, no decay): each step is lr · m
    with m = momentum · m + g, linear in the gradients, so the components' steps lr · m_c add up to it with no
    per-parameter scale. With a learning-rate schedule (``cfg.scheduled``) a :class:`ScheduledAdam` or
    :class:`ScheduledSGD`."""
    if cfg.optimizer == "sgd":
        if cfg.scheduled:
            return ScheduledSGD(model.parameters(), cfg, momentum=cfg.momentum)
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    fused = next(model.parameters()).device.type in ("cpu", "cuda")
    kw = {"betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps, "fused": fused}
    if cfg.scheduled:
        return ScheduledAdam(model.parameters(), cfg, **kw)
    return torch.optim.Adam(model.parameters(), lr=cfg.lr, **kw)


class Scheduled:
    """An optimizer (mixed in before it) whose groups' ``lr`` is always that of the step it takes next, ``cfg.lr_at``,
    so a checkpoint, a resumed run, an account and a replay that read ``lr`` before the step all see the step's rate.
    The count of steps taken is restored by ``load_state_dict`` (:meth:`steps_taken`); a run group's stacked optimizer
    (``runs.group``) is put on its members' step by :meth:`schedule_at`."""

    param_groups: list[dict]
    schedule_only = True  # steps as its base does (the account and the tracker accept it: engine.influence.plain_sgd)

    def _start(self, cfg: TrainConfig) -> None:
        self._lr_at, self._next = cfg.lr_at, 0
        self.schedule_at(0)

    def schedule_at(self, step: int) -> None:
        """Set the rate of step ``step`` (the next step to take)."""
        self._next = step
        for group in self.param_groups:
            group["lr"] = self._lr_at(step)

    def steps_taken(self) -> int:
        """Steps taken, from the loaded state."""
        raise NotImplementedError

    def step(self, closure=None):
        """The optimizer's step at the rate of step ``_next``; then the rate of the following step."""
        self.schedule_at(self._next)
        loss = super().step(closure)  # type: ignore[misc]
        self.schedule_at(self._next + 1)
        return loss

    def load_state_dict(self, state_dict) -> None:
        """The optimizer's ``load_state_dict``, then the rate of the next step from the loaded step count."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self.schedule_at(self.steps_taken())


class ScheduledAdam(Scheduled, torch.optim.Adam):
    """Adam on the schedule of ``cfg`` (:class:`Scheduled`), its steps counted by Adam's own step count."""

    def __init__(self, params, cfg: TrainConfig, **kw):
        torch.optim.Adam.__init__(self, params, lr=cfg.lr_at(0), **kw)
        self._start(cfg)

    def steps_taken(self) -> int:
        taken = [int(st["step"]) for st in self.state.values() if "step" in st]
        return taken[0] if taken else 0


class ScheduledSGD(Scheduled, torch.optim.SGD):
    """SGD (with ``momentum``) on the schedule of ``cfg`` (:class:`Scheduled`). SGD keeps no step count, so each
    group carries one, ``steps_taken``, saved and restored with the optimizer's state."""

    def __init__(self, params, cfg: TrainConfig, **kw):
        torch.optim.SGD.__init__(self, params, lr=cfg.lr_at(0), **kw)
        self._start(cfg)

    def schedule_at(self, step: int) -> None:
        super().schedule_at(step)
        for group in self.param_groups:
            group["steps_taken"] = step

    def steps_taken(self) -> int:
        return int(self.param_groups[0].get("steps_taken", 0))


def _truncate_metrics(path: Path, step: int):
    """Drop metric lines that a resumed run from ``step`` writes again: train losses after ``step`` (logged at
    the end of a step) and evaluations from ``step`` on (run at its start), and any half-written line."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec["step"] < step or rec["kind"] == "train" and rec["step"] == step:
            keep.append(line + "\n")
    atomic_write(path, "".join(keep))
