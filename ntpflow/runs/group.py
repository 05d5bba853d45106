"""Run groups: R runs of one regime (seeds) trained as one batched model, each written as an ordinary run directory.

Every parameter gets a leading run axis ``[R, ...]``. ``torch.func.vmap`` over ``functional_call`` runs the R models
on their own batches ``[R, batch, pos]`` in one pass, and one optimizer over the stacked parameters is R separate
ones (Adam and SGD with momentum are elementwise; a learning-rate schedule is the same for every member). Member r
uses exactly its own config: its seed's initial weights, its training set and its data order (``DataOrder``), so it
is the run ``train`` would make, up to the last bits of the arithmetic: batched kernels may round differently from
the single-run ones (measured in docs/run-groups.md).

Each member is an ordinary run directory (``config.json``, ``init``, ``metrics.jsonl``, ``ckpt/``,
``model.safetensors``, ``DONE``; see ``ntpflow.runs.training``) plus

    group.json   {"index": r, "members": [config dicts, in group order], "dirs": [member dirs relative to this one]}

which says that it was trained in a group. A group trains through the loop of a single run
(``ntpflow.runs.training.fit``: same cadence, checkpoints and resume) with the batched :class:`Stacked` step. Members
may keep the exact account while the group trains (``train_group(..., accounts=...)``: each such member's
``RUN_DIR/account``, as ``train --account`` keeps one), read by ``attribute`` without a replay. A member trained
without it is replayed: the replay (``ntpflow attribute``) goes through the same batched step
(:func:`replay_stepper`), so it reproduces the run bit for bit. A killed group resumes from the last checkpoint that
every member has, to the same bits (and the same accounts).
"""

import logging
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from ntpflow.files import DirLock, ensure_writable_dir, write_json
from ntpflow.model.gpt import GPT
from ntpflow.model.stack import RunStack
from ntpflow.runs.account import AccountSpec, RunAccount
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.data import DataOrder, make_datasets, to_torch
from ntpflow.runs.run import Run, load_latest, task_for
from ntpflow.runs.threads import kept_threads
from ntpflow.runs.training import (
    PlainSteps,
    Scheduled,
    fit,
    init_members,
    make_optimizer,
    prepare_run_dir,
    train_step,
)
from ntpflow.tasks import Batch

log = logging.getLogger(__name__)
PER_RUN = ("seed", "data_seed")  # the config fields in which the members of a group may differ




def stack_runs(models: Sequence[GPT], opts: Sequence[torch.optim.Optimizer], cfg: TrainConfig
               ) -> tuple[RunStack, torch.optim.Optimizer]:
    """One RunStack of ``models`` (on their device) and one optimizer of ``cfg`` (Adam or SGD, on its schedule) holding
    their optimizers' states stacked: each state tensor shaped as its parameter stacked over the runs, any other
    (Adam's step count, the same in every run) and the settings (a schedule's step count) taken from the first."""
    stack = RunStack(models).to(next(models[0].parameters()).device)
    group_opt = make_optimizer(stack, cfg)
    for i, s in enumerate(stack.stacked):
        params = [list(m.parameters())[i] for m in models]
        states = [o.state.get(p) for p, o in zip(params, opts)]
        present = [st for st in states if st]
        if len(present) == len(states):
            group_opt.state[s] = {k: torch.stack([st[k] for st in present]) if _per_param(v, params[0])
                                  else v.clone() if torch.is_tensor(v) else v for k, v in present[0].items()}
        elif present:
            raise ValueError("the runs of a group must resume from the same step")
    group_opt.param_groups[0].update(_settings(opts[0]))
    if isinstance(group_opt, Scheduled):
        group_opt.schedule_at(group_opt.steps_taken())
    return stack, group_opt


@torch.no_grad()
def export_member(stack: RunStack, r: int, group_opt: torch.optim.Optimizer, model: GPT,
                  opt: torch.optim.Optimizer) -> None:
    """Copy run r's weights and optimizer state out of the group into an ordinary ``model`` and its optimizer ``opt``
    (made by ``make_optimizer`` from the group's config): the inverse of :func:`stack_runs`. Each state tensor shaped
    as its stacked parameter gives run r's row, any other (Adam's step count) is copied whole, and so are the group's
    settings (the learning rate, a schedule's step count)."""
    model.load_state_dict(stack.member(r))
    for s, p in zip(stack.stacked, model.parameters()):
        st = group_opt.state.get(s)
        if st:
            opt.state[p] = {k: v[r].clone() if _per_param(v, s) else v.clone() if torch.is_tensor(v) else v
                            for k, v in st.items()}
        else:
            opt.state.pop(p, None)
    opt.param_groups[0].update(_settings(group_opt))
    if isinstance(opt, Scheduled):
        opt.schedule_at(opt.steps_taken())


def _settings(opt: torch.optim.Optimizer) -> dict:
    """An optimizer's settings (learning rate, a schedule's step count, ...): its parameter group less its params."""
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def _per_param(value, param: torch.Tensor) -> bool:
    """Whether an optimizer state ``value`` is a tensor shaped as its parameter ``param`` (a moment, a momentum
    buffer), stacked or not as ``param`` is."""
    return torch.is_tensor(value) and value.shape == param.shape


def group_step(stack: RunStack, opt: torch.optim.Optimizer, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One optimizer step of every run on its own batch (tokens, loss_mask [R, batch, pos]); returns the losses [R].

    The losses are summed before the backward pass: run r's parameters only reach its own loss, so each gets
    exactly its own gradient."""
    losses = stack.losses(tokens, loss_mask)
    opt.zero_grad(set_to_none=True)
    losses.sum().backward()
    opt.step()
    return losses.detach()


class GroupData:
    """The members' training sets stacked on ``device`` and their data orders: ``batch(step)`` -> tokens,
    loss_mask [R, batch, pos], run r's rows being ``DataOrder(seed_r)(step)`` of its own training set."""

    def __init__(self, cfgs: Sequence[TrainConfig], device, sets: Sequence[tuple[Batch, Batch]] | None = None):
        """``sets``: the members' (train, eval) sets when the caller has them (a replay's cached ``run.datasets()``);
        built from ``cfgs`` otherwise."""
        if sets is None:
            task = task_for(cfgs[0])
            sets = [make_datasets(c, task) for c in cfgs]
        train = [to_torch(tr, device) for tr, _ in sets]
        self.evals = [to_torch(ev, device) for _, ev in sets]
        self.eval_types = [ev.feature_types for _, ev in sets]  # [n_eval, pos, n_features] or None per member
        self.tokens = torch.stack([t["tokens"] for t in train])  # [R, n_train, pos]
        self.loss_mask = torch.stack([t["loss_mask"] for t in train])
        self.orders = [DataOrder(c.seed, c.n_train, c.batch_size) for c in cfgs]
        self.rows = torch.arange(len(cfgs), device=device)[:, None]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, loss_mask) [R, batch, pos] of ``step``."""
        idx = torch.stack([o(step) for o in self.orders]).to(self.rows.device)  # [R, batch]
        return self.tokens[self.rows, idx], self.loss_mask[self.rows, idx]


def check_group(cfgs: Sequence[TrainConfig]) -> None:
    """ValueError unless the configs differ only in ``seed`` and ``data_seed`` (one regime, one schedule)."""
    if not cfgs:
        raise ValueError("a run group needs at least one run")
    base = {k: v for k, v in cfgs[0].to_dict().items() if k not in PER_RUN}
    for c in cfgs[1:]:
        diff = sorted(k for k, v in c.to_dict().items() if k not in PER_RUN and base[k] != v)
        if diff:
            raise ValueError(f"the runs of a group may differ only in {' and '.join(PER_RUN)}; "
                             f"these differ: {', '.join(diff)}")


def group_record(cfgs: Sequence[TrainConfig], run_dirs: Sequence[Path], r: int) -> dict:
    """The ``group.json`` of member r."""
    return {"index": r, "members": [c.to_dict() for c in cfgs],
            "dirs": [os.path.relpath(d, run_dirs[r]) for d in run_dirs]}


def _prepare(runs: Sequence[Run]) -> None:
    """Create the member dirs (``group.json`` first), or check that existing ones belong to this group."""
    cfgs, run_dirs = [run.cfg for run in runs], [run.dir for run in runs]
    for r, run in enumerate(runs):
        record = group_record(cfgs, run_dirs, r)
        if run.in_group:
            if run.group_record()["members"] != record["members"]:
                raise ValueError(f"{run.dir} holds a run of another run group; choose another output directory")
        elif run.config_path.exists():
            raise ValueError(f"{run.dir} holds a run trained alone; a run group cannot take it over")
        else:
            ensure_writable_dir(run.dir)
            write_json(run.group_path, record)
        prepare_run_dir(run)


def train_group(cfgs: Sequence[TrainConfig], run_dirs: Sequence[str | Path], *, progress: bool = True,
                accounts: Sequence[AccountSpec | None] | None = None) -> list[Run]:
    """Train the runs ``cfgs`` (one regime, different seeds) as one batched model into ``run_dirs``, resuming from
    the last checkpoint that every member has. Returns the member Runs (each readable like one from ``train``).

    ``accounts``: per member, the exact account to keep while the group trains (``train --account``: the member's
    ``RUN_DIR/account``, read by ``attribute`` without a replay), or None; the weights are the same bits either way."""
    cfgs, run_dirs = list(cfgs), [Path(d) for d in run_dirs]
    check_group(cfgs)
    if len(cfgs) != len(run_dirs) or len({d.resolve() for d in run_dirs}) != len(run_dirs):
        raise ValueError("a run group needs one distinct run directory per config")
    accounts = list(accounts) if accounts is not None else [None] * len(cfgs)
    if len(accounts) != len(cfgs):
        raise ValueError("a run group takes one account (or None) per member")
    runs = [Run(d, c) for c, d in zip(cfgs, run_dirs)]
    kept = [(run, spec) for run, spec in zip(runs, accounts) if spec is not None]
    for run in runs:
        run.task  # a bad task setting fails before anything is written
    for run, spec in kept:
        spec.check(run)  # bad sites or sizes too
    _prepare(runs)
    with ExitStack() as locks, kept_threads():
        for run in runs:  # one writer per run directory
            locks.enter_context(DirLock(run.dir))
        _prepare(runs)
        for run, spec in kept:  # again under the lock
            spec.check(run)
            spec.prepare(run)
        if not all(run.done for run in runs):
            fit(runs, Stacked, progress=progress)
    return runs


class Stacked(PlainSteps):
    """The members of a run group stepping as one batched model (a :class:`~ntpflow.runs.training.Stepper`): the
    models and optimizers stacked (:func:`stack_runs`; :func:`export_member` copies one back), one
    :func:`group_step` per step on the batches [R, batch, pos].

    A member whose run keeps an account (``RUN_DIR/account``, :class:`~ntpflow.runs.account.RunAccount`) has it
    kept here: before each group step its state is copied into its own model and optimizer, and its account takes
    the step's account from there (``ExactAccount.account_step``: its own ordinary backward of its batch); the group
    then steps as without accounts, so the weights are the same bits. The accounts are kept one member after
    another."""

    def __init__(self, runs: Sequence[Run], models: Sequence[GPT], opts: Sequence[torch.optim.Optimizer], device):
        self.data = GroupData([run.cfg for run in runs], device)
        self.evals, self.models, self.opts = self.data.evals, list(models), list(opts)
        self.stack, self.group_opt = stack_runs(self.models, self.opts, runs[0].cfg)
        self.kept = {r: RunAccount(run, model, opt, ev["tokens"], types) for r, (run, model, opt, ev, types)
                     in enumerate(zip(runs, self.models, self.opts, self.evals, self.data.eval_types))
                     if run.account.spec.exists()}

    def step(self, step: int) -> torch.Tensor:
        tokens, loss_mask = self.data.batch(step)
        for r, kept in self.kept.items():
            export_member(self.stack, r, self.group_opt, self.models[r], self.opts[r])
            kept.account.account_step(tokens[r], loss_mask[r])
        return group_step(self.stack, self.group_opt, tokens, loss_mask)

    def resume(self, start: int, states: list[dict[str, torch.Tensor]]) -> None:
        for r, kept in self.kept.items():
            kept.resume(start, states[r] if states else {})

    def extra_state(self) -> list[dict[str, torch.Tensor]]:
        return [self.kept[r].state() if r in self.kept else {} for r in range(len(self.models))]

    def finish(self) -> None:
        self.members()  # the final weights in each member's model
        for kept in self.kept.values():
            kept.finish()

    def members(self) -> list[tuple[GPT, torch.optim.Optimizer]]:
        for r, (model, opt) in enumerate(zip(self.models, self.opts)):
            export_member(self.stack, r, self.group_opt, model, opt)
        return list(zip(self.models, self.opts))

    def weights_finite(self) -> torch.Tensor:
        return self.stack.finite()


class GroupReplay:
    """Advances the replays of members of a run group as the group trained them: the whole group takes each step
    (rebuilt from the members' common training checkpoint on the first call), then each joined member r's weights
    and optimizer state are copied into its replay's ``model`` and ``opt``. ``join(r, model, opt)`` adds member r,
    whose ``model`` must hold the group's state at the next step. Call as ``stepper(step, *batch)``: any batch given
    is ignored, the group's batches [R, batch, pos] are recomputed here."""

    def __init__(self, run: Run, device, known: Sequence[Run] = ()):
        """``run``: a member; ``known``: members already open (their cached datasets are used, not built again)."""
        record = run.group_record()
        self.index, self.device = record["index"], device
        self.cfgs = [TrainConfig.from_dict(d) for d in record["members"]]
        if self.cfgs[self.index].hash() != run.cfg.hash():
            raise ValueError(f"{run.group_path} does not describe the run in {run.dir}")
        opened = {r.dir.resolve(): r for r in (run, *known)}
        self.runs = [opened.get((run.dir / d).resolve()) or Run((run.dir / d).resolve(), c)
                     for d, c in zip(record["dirs"], self.cfgs)]
        self.data = GroupData(self.cfgs, device, [r.datasets() for r in self.runs])
        self.members: dict[int, tuple[GPT, torch.optim.Optimizer]] = {}
        self.next_step: int | None = None
        self.stack: RunStack | None = None
        self.group_opt: torch.optim.Optimizer | None = None

    def join(self, r: int, model: GPT, opt: torch.optim.Optimizer) -> None:
        """From the next step on, copy run r's state into ``model`` and ``opt`` after each group step."""
        if self.stack is not None:
            self._check(r, model)
        self.members[r] = (model, opt)

    def _check(self, r: int, model: GPT) -> None:
        assert self.stack is not None  # brought to a step first (_seek)
        ours = {n: s[r] for n, s in zip(self.stack.names, self.stack.stacked)}
        if any(not torch.equal(v, ours[n]) for n, v in model.named_parameters()):
            raise RuntimeError(f"the replay state of {self.runs[r].dir} disagrees with its group's checkpoints")

    def _seek(self, step: int) -> None:
        """Bring the group to ``step``: load the common checkpoint before it (if every member dir has one), step on."""
        models, opts = init_members(self.runs, self.device)
        have = all(run.config_path.exists() and Run.open(run.dir).cfg.hash() == run.cfg.hash() for run in self.runs)
        at = load_latest([run.ckpts for run in self.runs], models, opts, self.device, step)[0] if have else 0
        self.stack, self.group_opt = stack_runs(models, opts, self.cfgs[0])
        for s in range(at, step):
            group_step(self.stack, self.group_opt, *self.data.batch(s))
        self.next_step = step
        for r, (model, _) in self.members.items():
            self._check(r, model)

    def state(self, step: int) -> tuple[RunStack, torch.optim.Optimizer]:
        """The group's stacked weights and optimizer before ``step`` (brought there first, if they are elsewhere)."""
        if step != self.next_step:
            self._seek(step)
        assert self.stack is not None and self.group_opt is not None  # set by _seek
        return self.stack, self.group_opt

    def __call__(self, step: int, *batch, export: bool = True) -> None:
        """Take the group's ``step``; then, with ``export``, copy each joined member's state into its model and
        optimizer (a caller that reads them only now and then may skip it in between)."""
        stack, group_opt = self.state(step)
        group_step(stack, group_opt, *self.data.batch(step))
        if export:
            for r, (model, opt) in self.members.items():
                export_member(stack, r, group_opt, model, opt)
        self.next_step = step + 1


def group_dirs(run: Run) -> list[Path]:
    """The run directories of every member of ``run``'s group, in group order (ValueError if it was trained alone)."""
    if not run.in_group:
        raise ValueError(f"{run.dir} was trained alone, not in a run group")
    return [(run.dir / d).resolve() for d in run.group_record()["dirs"]]


def member_indices(runs: Sequence[Run]) -> list[int]:
    """Each run's index in its group; ValueError (one line) unless ``runs`` are distinct members of one group."""
    groups, index = set(), []
    for run in runs:
        dirs = tuple(group_dirs(run))
        record = run.group_record()
        r = record["index"]
        if dirs[r] != run.dir.resolve() or TrainConfig.from_dict(record["members"][r]).hash() != run.cfg.hash():
            raise ValueError(f"{run.group_path} does not describe the run in {run.dir}")
        groups.add(dirs)
        index.append(r)
    if len(groups) > 1:
        raise ValueError("the run dirs are not all members of one run group (see their group.json)")
    if len(set(index)) < len(index):
        raise ValueError("a run dir is given twice")
    return index


def replay_stepper(run: Run, model: GPT, opt: torch.optim.Optimizer, device
                   ) -> Callable[[int, torch.Tensor, torch.Tensor], object]:
    """How a replay advances ``model`` and ``opt`` by step ``step`` of ``run`` (``stepper(step, tokens, loss_mask)``):
    ``train_step`` for a run trained alone, the group's batched step (:class:`GroupReplay`) for a group member."""
    if run.in_group:
        stepper = GroupReplay(run, device)
        stepper.join(stepper.index, model, opt)
        return stepper
    return lambda step, tokens, loss_mask: train_step(model, opt, tokens, loss_mask)
