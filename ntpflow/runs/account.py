"""Training with the exact account (``ntpflow train --account SITES``): one pass that trains the run and keeps the
account's accumulators (``ntpflow.engine.exact``) in ``RUN_DIR/account``, so that ``attribute`` reads them instead of
replaying the run.

``RUN_DIR/account`` (:class:`~ntpflow.runs.run.AccountDir`)::

    spec.json                                 sites, readout size, chunk length, rows, rule
    chunks/chunk_NNNNNN.safetensors(+.json)   one per chunk of steps (written when the chunk ends, sidecar last)
    final.safetensors(+.json)                 θ*'s readout residuals per site and the counters: the account is done

The running chunk, the tracker's moments and the readout's residual travel in the training checkpoints (extras
``account.*``; the newest two keep them), so an interrupted run resumes to the same account.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ntpflow.engine.exact import ExactAccount
from ntpflow.files import load_tensors, read_json, save_tensors, sidecar, write_json
from ntpflow.model.gpt import GPT
from ntpflow.model.sites import Site, checked_sites, feature_name
from ntpflow.runs.run import AccountDir, Checkpoints, Run, RunPaths
from ntpflow.runs.training import Alone
from ntpflow.runs.workers import is_lead

DEFAULT_READOUT = 256  # the most sequences of the default readout set of the exact account
DEFAULT_CHUNKS = 100  # the most chunks of steps an account keeps (its curves' resolution)
ACCOUNT_RTOL = 1e-4  # without θ*, a step is judged by its displacement and second moment: a tighter rtol (exact.py)


def default_readout(n_eval: int, batch_size: int) -> int:
    """The default readout set's size: the run's batch, at most DEFAULT_READOUT and ``n_eval``, at least 2 (the exact
    account's cost grows with readout / batch, docs/balance.md)."""
    return max(2, min(DEFAULT_READOUT, n_eval, batch_size))


@dataclass(frozen=True)
class AccountSpec:
    """What ``train --account`` keeps: the residual ``sites``, the readout set's size (None: :func:`default_readout`),
    at most ``chunks`` chunks of steps, whether the SGD-direction rows are kept beside the optimizer's, and the
    features whose per-type rows are kept (``types``: a task that labels its features by type on the readout, as
    Othello's squares; each costs two d × d accumulators per type and row)."""

    sites: tuple[Site, ...]
    readout: int | None = None
    chunks: int = DEFAULT_CHUNKS
    sgd_rows: bool = True
    types: tuple[str, ...] = ()

    def cli_args(self) -> list[str]:
        """The ``ntpflow train`` options that keep this account (``--account ... --chunks ...``); ValueError without
        the SGD rows, which the command line always keeps."""
        if not self.sgd_rows:
            raise ValueError("ntpflow train --account keeps the SGD-direction rows; an account without them is "
                             "Python's only (ntpflow.train(..., account=AccountSpec(..., sgd_rows=False)))")
        args = ["--account", ",".join(f"{s.layer}:{s.pos}" for s in self.sites), "--chunks", str(self.chunks)]
        if self.readout is not None:
            args += ["--readout", str(self.readout)]
        if self.types:
            args += ["--account-types", ",".join(self.types)]
        return args

    def resolved(self, run: Run) -> dict:
        """The spec.json of this account on ``run``; ValueError (one line) for sites or sizes the run cannot take."""
        cfg = run.cfg
        sites = checked_sites(self.sites, run.model_config().n_layer, run.task.seq_len)
        if not sites:
            raise ValueError("--account needs at least one site (LAYER:POS[,LAYER:POS...])")
        readout = self.readout or default_readout(cfg.n_eval, cfg.batch_size)
        if not 2 <= readout <= cfg.n_eval:
            raise ValueError(f"--readout takes 2..{cfg.n_eval} (the run's evaluation sequences), got {readout}")
        if self.chunks < 1:
            raise ValueError(f"the account needs at least one chunk, not {self.chunks}")
        spec = {"sites": [[s.layer, s.pos] for s in sites], "readout": readout,
                "chunk_steps": math.ceil(cfg.steps / min(self.chunks, cfg.steps)), "sgd_rows": self.sgd_rows,
                "rtol": ACCOUNT_RTOL, "config_hash": cfg.hash()}
        if self.types:
            names = [feature_name(f) for f in self.types]
            unknown = [f for f in names if f not in run.task.feature_names]
            if unknown:
                raise ValueError(f"--account-types: unknown feature(s) {unknown}; the task has "
                                 f"{list(run.task.feature_names)}")
            if run.task.sample(2, np.random.default_rng(0)).feature_types is None:
                raise ValueError(f"--account-types: the task {cfg.task} labels no feature by type")
            spec["types"] = list(dict.fromkeys(names))
        return spec


    def check(self, run: Run) -> None:
        """ValueError (one line) unless ``run`` can be trained with this account (:meth:`resolved`): a new run, or
        one begun (or finished) with the same account (one of other sites or steps, or none, is refused)."""
        check_accountable(run, self.resolved(run))

    def prepare(self, run: Run) -> None:
        """Create the run's account folder with its spec.json."""
        folder = run.account
        folder.chunks.mkdir(parents=True, exist_ok=True)
        if not folder.spec.exists():
            write_json(folder.spec, self.resolved(run))

    @property
    def stepper(self):
        """The training's stepper (``runs.training.Stepper``): :class:`Accounted`."""
        return Accounted


def account_for(run_dir: str | Path, sites: Sequence[Site], readout: int | None) -> AccountSpec | None:
    """The account an experiment's run trains with: at ``sites`` on ``readout`` sequences, unless the run was begun or
    finished without one (such a run is replayed, as before the account existed); None without sites."""
    paths = RunPaths(run_dir)
    begun = paths.config_path.exists() and (paths.done_path.exists() or bool(Checkpoints(paths.ckpt_dir).steps()))
    if not sites or (begun and not paths.account.spec.exists()):
        return None
    return AccountSpec(tuple(sites), readout)


def check_accountable(run: Run, spec: dict) -> None:
    """ValueError (one line) unless ``run`` can be trained with the account ``spec`` (see ``AccountSpec.check``)."""
    folder = run.account
    if folder.spec.exists():
        old = read_json(folder.spec)
        if {k: old.get(k) for k in spec} != spec:
            raise ValueError(f"{run.dir} keeps an account of other sites, steps or settings ({folder.spec}); train "
                             "into another folder")
    elif run.config_path.exists() and (run.done or run.checkpoints()):
        raise ValueError(f"{run.dir} was trained without --account: attribute replays it, or train into another "
                         "folder")


class RunAccount:
    """The account one run keeps while it trains, as its ``RUN_DIR/account/spec.json`` says: an
    :class:`~ntpflow.engine.exact.ExactAccount` on the run's model and optimizer whose finished chunks go to the
    folder. Shared by a run trained alone (:class:`Accounted`) and the members of a run group
    (``ntpflow.runs.group.Stacked``).

    eval_tokens: the run's evaluation sequences [n_eval, pos] on the device (the readout is their first ``readout``);
    eval_types: their feature-type labels [n_eval, pos, n_features] (numpy; only for an account that keeps types)."""

    def __init__(self, run: Run, model: GPT, opt: torch.optim.Optimizer, eval_tokens: torch.Tensor,
                 eval_types: np.ndarray | None):
        self.run, self.folder = run, run.account
        spec = read_json(self.folder.spec)
        tokens = eval_tokens[:spec["readout"]]
        types = {}
        if spec.get("types"):
            assert eval_types is not None  # checked by AccountSpec.resolved
            labels = torch.as_tensor(eval_types[:spec["readout"]], device=tokens.device)
            types = {f: labels[..., run.task.feature_names.index(f)].long() for f in spec["types"]}
        self.account = ExactAccount(model, opt, [Site(*s) for s in spec["sites"]], tokens,
                                    chunk_steps=spec["chunk_steps"], sgd_rows=spec["sgd_rows"], rtol=spec["rtol"],
                                    on_chunk=self._write_chunk, types=types)

    def _write_chunk(self, first: int, tensors: dict[str, torch.Tensor]) -> None:
        if is_lead():
            save_tensors(self.folder.chunk(first), tensors, {"first": first, "config_hash": self.run.cfg.hash()})

    def resume(self, start: int, state: dict[str, torch.Tensor]) -> None:
        """Restore the account saved with the checkpoint of step ``start`` (``state``: that checkpoint's tensors;
        start 0: start over) and drop the chunks written after it."""
        tensors = {k[len("account."):]: v for k, v in state.items() if k.startswith("account.")}
        if start and not tensors:
            raise ValueError(f"{self.run.dir}'s checkpoint of step {start} holds no account state (trained without "
                             "--account, or an older checkpoint: only the newest two keep it); train into another "
                             "folder")
        if tensors:
            self.account.load_state_dict(tensors)
        running = self.account._first if self.account._chunk else start
        for path in self.folder.chunk_files() if is_lead() else ():
            if int(path.stem.split("_")[1]) >= running:
                sidecar(path).unlink(missing_ok=True)
                path.unlink(missing_ok=True)

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the account (``account.*``)."""
        return {f"account.{k}": v for k, v in self.account.state_dict().items()}

    def finish(self) -> None:
        """The last chunk, then θ*'s readout residuals and the counters (``final.safetensors``: the account is done),
        from the model holding the final weights."""
        acc = self.account
        acc.end_chunk()  # every worker: the chunk is gathered
        if not is_lead():
            return
        with torch.no_grad():
            resid = acc.model(acc.tokens, return_resid=True, myopic="none")[1]
        labels = {f"types.{f}": lab for f, lab in acc.types.items()}
        save_tensors(self.folder.final, {f"final_resid.{s.layer}:{s.pos}": resid[s.layer][:, s.pos].to(torch.float64)
                                         for s in acc.sites} | labels,
                     {"steps": self.run.cfg.steps, "refined_steps": acc.refined, "subdivided_steps": acc.subdivided,
                      "point_evaluations": acc.evaluations, "own": acc.own, "rows": [list(r) for r in acc.names],
                      "rule": {"levels": list(acc.rule.levels), "pieces": list(acc.rule.pieces),
                               "rtol": acc.rule.rtol, "floor": acc.rule.floor, "stall": acc.rule.stall},
                      "config_hash": self.run.cfg.hash()})


class Accounted(Alone):
    """One run trained alone with the exact account (a :class:`~ntpflow.runs.training.Stepper`): each step is the
    account's (the same ordinary backward and optimizer step as ``train_step``, so the weights are the same bits)."""

    def __init__(self, runs: Sequence[Run], models: Sequence[GPT], opts: Sequence[torch.optim.Optimizer], device):
        super().__init__(runs, models, opts, device)
        self.kept = RunAccount(runs[0], self.model, self.opt, self.evals[0]["tokens"], self.eval_set.feature_types)

    def resume(self, start: int, states: list[dict[str, torch.Tensor]]) -> None:
        self.kept.resume(start, states[0] if states else {})

    def step(self, step: int) -> torch.Tensor:
        idx = self.order(step).to(self.device)
        return self.kept.account.train_step(self.data["tokens"][idx], self.data["loss_mask"][idx]).detach()[None]

    def extra_state(self) -> list[dict[str, torch.Tensor]]:
        return [self.kept.state()]

    def finish(self) -> None:
        self.kept.finish()


@dataclass(frozen=True)
class KeptAccount:
    """A finished account read back: ``spec`` (spec.json), ``meta`` (final.json: rows, rule, counters), θ*'s readout
    residuals ``final`` {site: [N, d]} and the chunk files in step order."""

    folder: AccountDir
    spec: dict
    meta: dict
    final: dict[Site, torch.Tensor]
    types: dict[str, torch.Tensor]  # the kept features' type labels on the readout [N, pos]

    @property
    def sites(self) -> list[Site]:
        return [Site(*s) for s in self.spec["sites"]]

    @property
    def rows(self) -> list[tuple[str, str]]:
        return [tuple(r) for r in self.meta["rows"]]

    def chunks(self):
        """(first step, tensors) of each chunk, in step order (read one at a time)."""
        for path in self.folder.chunk_files():
            yield int(path.stem.split("_")[1]), load_tensors(path)


def account_sites(run: Run) -> list[Site]:
    """The sites of the account ``run`` was trained with (``train --account``); none without one."""
    spec = run.account.spec
    return [Site(*s) for s in read_json(spec)["sites"]] if spec.exists() else []


def read_account(run: Run) -> KeptAccount | None:
    """The run's finished account, or None when it was trained without one (or its account did not finish)."""
    folder = run.account
    if not sidecar(folder.final).exists():
        return None
    spec, meta = read_json(folder.spec), read_json(sidecar(folder.final))
    if spec.get("config_hash") != run.cfg.hash():
        raise ValueError(f"{folder.dir} was kept for another config than {run.dir}'s")
    tensors = load_tensors(folder.final)
    final = {Site.parse(k.split(".", 1)[1]): v for k, v in tensors.items() if k.startswith("final_resid.")}
    types = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("types.")}
    return KeptAccount(folder, spec, meta, final, types)
