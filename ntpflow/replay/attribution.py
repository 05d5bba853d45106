"""The two-run protocol: replay a finished run from its initial weights and track influence at every step.

Output folder (default ``RUN_DIR/attribution``)::

    spec.json           sites, features, the run's config hash, whether SGD rows are written (``sgd_rows``)
    parts/part_*.parquet  rows per block of steps (written before the state that covers them)
    state/step_000500.safetensors(+.json)  model, Adam and tracker state at a block boundary (resume point, in the
                        run's checkpoint format: the sidecar is written last; the last two are kept)
    influence.parquet   all rows {step, layer, pos, feature, feature_type, mismatch, component, optimizer, value,
                        cumulative, task, regime, seed}; mismatch "paper" (R) or "centred" (R_c, see
                        ntpflow.engine.influence); the schema of every column: docs/outputs.md
    summary.json        per probe and mismatch: integrated influence per component vs the mismatch removed,
                        R(θ_0) − R(θ_T) on held-out data, and the offset share of R(θ_0), mean² / R
    matrices.safetensors  (``matrices=True``) every site's influence matrices (``ntpflow.replay.matrices``)

**Positive influence means the component moved the feature toward its final value.**
"""

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from ntpflow.engine.influence import MISMATCHES, InfluenceTracker, Probe, mismatch_value
from ntpflow.engine.run_axis import RunAxisTracker
from ntpflow.files import (
    DirLock,
    ensure_writable_dir,
    fault_point,
    read_json,
    resolve_device,
    stamp,
    write_json,
)
from ntpflow.model.sites import Site, checked_sites, feature_name
from ntpflow.progress import progress_of
from ntpflow.replay.answer import shares, useful_flag
from ntpflow.replay.conditioning import condition, conditioning_lines, step_kappas
from ntpflow.replay.directions import direction_probes, direction_records
from ntpflow.replay.from_account import account_rows, rule_text, save_account_matrices
from ntpflow.replay.matrices import save_matrices
from ntpflow.runs.account import DEFAULT_READOUT, KeptAccount, default_readout, read_account
from ntpflow.runs.data import DataOrder, to_torch
from ntpflow.runs.group import GroupReplay, member_indices, replay_stepper
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import AttributionDir, Checkpoints, Run
from ntpflow.runs.threads import follow_threads
from ntpflow.runs.training import make_optimizer
from ntpflow.tasks import Batch

log = logging.getLogger(__name__)
KEY = ("layer", "pos", "feature", "feature_type", "mismatch", "component", "optimizer")


def check_features(run: Run, features: Sequence[str] | None) -> None:
    """ValueError (one line) for a name in ``features`` that is not one of the run's task features; called before an
    output folder is made."""
    known = list(run.task.feature_names)
    unknown = [n for n in (feature_name(f) for f in features or ()) if n not in known]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; the task has {known}")


def make_probes(run: Run, sites: Sequence[Site], features: Sequence[str] | None, device="auto") -> list[Probe]:
    """Probe directions of the run's final ridge probes (fitted first if absent) at ``sites`` × ``features``."""
    probes = load_or_probe(run, "final", device)
    if probes.metadata.get("config_hash") != run.cfg.hash():
        raise ValueError(f"the probes in {run.probes_dir('final')} were fitted on another run")
    names = [feature_name(f) for f in features] if features else list(probes.feature_names)
    unknown = [n for n in names if n not in probes.feature_names]
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; the task has {list(probes.feature_names)}")
    out = []
    for s in sites:
        s.check(run.model_config().n_layer, run.task.seq_len)
        if s.pos not in probes.positions:
            raise ValueError(f"site {s} has no probe (probed positions: {probes.positions[0]}..{probes.positions[-1]})")
        out += [Probe(s, n, probes.direction(s.layer, s.pos, n)) for n in names]
    return out


def attribute(run_dir: str | Path, sites: Sequence[Site], features: Sequence[str] | None = None, *,
              out_dir: str | Path | None = None, device: str = "auto", block: int | None = None,
              progress: bool = True, force_unlock: bool = False, sgd_rows: bool = True,
              reading: str = "exact", readout: int | None = None, directions: dict | None = None,
              matrices: bool = False, replay: bool = False) -> Path:
    """Replay the run at ``run_dir`` with influence tracking at ``sites`` × ``features``; returns the output dir.

    A run trained with the account (``train --account``) is not replayed: its exact account is read from
    ``RUN_DIR/account`` when it covers the sites (and ``readout``, if given, is its own), for any features and
    directions (``ntpflow.replay.from_account``); ``replay=True`` replays it all the same.

    The replay must reproduce the run's final weights bit for bit, else it raises RuntimeError. It resumes from
    its last saved state when interrupted. ``block`` (default: the run's ``ckpt_every``) is the number of steps
    between saved states. ``force_unlock`` takes over a lock left by a process on another host. ``sgd_rows=False``
    writes the Adam rows only (about 30 % less tracking work at the toy load; what the experiments read).
    ``reading`` says what the influence splits (docs/balance.md): ``"exact"`` (the default) is the exact account:
    R and R_c read on a fixed readout set, the first ``readout`` evaluation sequences (default the run's batch size,
    at most 256 and n_eval), each step's exact change of them measured, and each component's share of it a path
    integral along the step (adaptive Gauss–Legendre, ``InfluenceTracker.use_readout``); summary.json gives every
    row's residual. ``"paper"`` is the paper's reading: R on each step's batch, ∇R at the step's start θ_t;
    ``"midpoint"`` the same batch, ∇R at the step's midpoint.
    ``directions`` {name: (Site, tensor, array or path)}: directions of one's own, tracked as features named
    ``name`` beside the task's (``ntpflow.replay.directions``; with empty ``sites``, instead of them).
    ``matrices=True`` (the exact account only) also saves every site's influence matrices, from which any
    direction's influence can be read afterwards (``ntpflow.replay.matrices.direction_influence``,
    ``ntpflow discover``).
    """
    run = Run.open(run_dir)
    if not run.done:
        raise ValueError(f"{run_dir} has not finished training; attribution replays a finished run")
    cfg = run.cfg
    readout_size(reading, readout, cfg.n_eval, cfg.batch_size)  # checked before the account is read
    dev = resolve_device(device if device != "auto" else cfg.device)
    sites = run_sites(run, sites) if sites or not directions else []
    mc = run.model_config()
    extra = direction_probes(directions or {}, mc.n_layer, run.task.seq_len, mc.d_model, run.task.feature_names)
    kept = None if reading != "exact" or replay else read_account(run)
    if kept is not None and not ({*sites, *(p.site for p in extra)} <= set(kept.sites)
                                 and readout in (None, kept.spec["readout"])):
        log.info("%s's account (sites %s, readout %d) does not cover this attribution: replaying the run", run.dir,
                 ", ".join(f"{s.layer}:{s.pos}" for s in kept.sites), kept.spec["readout"])
        kept = None
    typed = [] if kept is None or not sites or run.datasets()[1].feature_types is None else [
        f for f in (feature_name(f) for f in features or run.task.feature_names) if f not in kept.types]
    if typed:
        log.info("%s's task labels its features by type (e.g. Othello's squares) and its account keeps no per-type "
                 "rows of %s (train --account-types): replaying the run", run.dir, ", ".join(typed[:5])
                 + (f" and {len(typed) - 5} more" if len(typed) > 5 else ""))
        kept = None
    readout = kept.spec["readout"] if kept is not None else readout_size(reading, readout, cfg.n_eval,
                                                                          cfg.batch_size)
    if matrices and readout is None:
        raise ValueError("--matrices needs the exact account (not --paper or --midpoint)")
    if sites:
        check_features(run, features)  # before the output folder is made
    out = ensure_writable_dir(run.attribution(out_dir).dir)
    with DirLock(out, force=force_unlock):  # one writer per attribution folder
        if kept is not None:
            return _from_account(run, kept, out, sites, features, dev, device, extra, matrices)
        return _replay(run, out, sites, features, dev, device, block, progress, sgd_rows, reading == "midpoint",
                       readout, extra, matrices)


def _from_account(run: Run, kept: KeptAccount, out: Path, sites: list[Site], features, dev, device,
                  extra: Sequence[Probe], matrices: bool) -> Path:
    """The attribution of a run trained with the account: rows, summary (and matrices) read from its account."""
    folder = AttributionDir(out)
    task_probes = make_probes(run, sites, features, device) if sites else []
    probes = task_probes + list(extra)
    spec = {"sites": [[s.layer, s.pos] for s in sites], "features": sorted({p.name for p in task_probes}),
            "config_hash": run.cfg.hash(), "sgd_rows": kept.spec["sgd_rows"], "midpoint": False, "run_axis": False,
            "readout": kept.spec["readout"], "directions": direction_records(extra), "matrices": matrices,
            "account": True}
    if folder.spec.exists():
        old = read_json(folder.spec)
        if old == spec and folder.done:
            return out
        if old != spec:
            raise ValueError(f"{out} holds another attribution (other sites, features, directions or a replay's); "
                             "write to another folder (attribute --out) or remove it")
    write_json(folder.spec, spec)
    folder.parts.mkdir(exist_ok=True)
    for part in folder.part_files():
        part.unlink()
    _write_part(folder.part(0), account_rows(kept.chunks(), kept.final, kept.meta["own"], kept.rows, probes,
                                             kept.types))
    if matrices:  # before influence.parquet, which marks the folder done
        save_account_matrices(out, kept, {"readout": kept.spec["readout"], "steps": run.cfg.steps,
                                          "config_hash": run.cfg.hash(), "optimizer": kept.meta["own"]})
    _, eval_set = run.datasets()
    notes = {k: kept.meta[k] for k in ("refined_steps", "subdivided_steps", "point_evaluations")}
    _finish(out, run, probes, run.load_model("final", dev), eval_set, dev, kept.spec["readout"],
            {**notes, "rule": rule_text(kept.meta), "account": True, "chunk_steps": kept.spec["chunk_steps"]})
    return out


READINGS = ("exact", "paper", "midpoint")
def readout_size(reading: str, readout: int | None, n_eval: int, batch_size: int = DEFAULT_READOUT) -> int | None:
    """The readout set's size for ``reading`` (None for the paper's batch readings); ValueError (one line) for an
    unknown reading, a size outside 2..n_eval, or a size given to a batch reading. The default is the run's batch
    (at most DEFAULT_READOUT and n_eval, at least 2): the exact account's cost grows with readout / batch (1.34× the
    midpoint replay at readout = batch, 2.60× at 4 × batch, BENCHMARKS.md), so the default stays near 1.3×; a larger
    readout makes R_H a closer estimate of the mismatch over the data, not the split more exact (docs/balance.md)."""
    if reading not in READINGS:
        raise ValueError(f"unknown reading {reading!r}; choose one of {', '.join(READINGS)}")
    if reading != "exact":
        if readout is not None:
            raise ValueError(f"--readout sets the exact account's readout set; it does not combine with --{reading}")
        return None
    if readout is None:
        return default_readout(n_eval, batch_size)
    if not 2 <= readout <= n_eval:
        raise ValueError(f"--readout takes 2..{n_eval} (the run's evaluation sequences), got {readout}")
    return readout


def attribute_group(run_dirs: Sequence[str | Path], sites: Sequence[Site], features: Sequence[str] | None = None, *,
                    out_dirs: Sequence[str | Path | None] | None = None, device: str = "auto", block: int | None = None,
                    progress: bool = True, force_unlock: bool = False, sgd_rows: bool = True,
                    reading: str = "exact", readout: int | None = None, run_axis: bool = True) -> list[Path]:
    """Replay members of one run group together, tracking each at ``sites`` × ``features``; returns the output dirs.

    One pass over the steps: before each step the members are tracked, then the group takes the step once for all
    (``GroupReplay``). With ``run_axis`` (the default, for tasks without feature types) the members are tracked in
    one vmapped pass over the run axis (``ntpflow.engine.run_axis``): their values agree with :func:`attribute`'s to
    rounding, and all members resume from one step (a member saved later goes back to its previous resume
    point). Without it, each member's tracker runs on its own model and Adam, one after another, and each folder
    comes out bit for bit as :func:`attribute` writes it; members resume from their own last saved state. Each
    member writes to its own folder (``out_dirs``, default ``RUN_DIR/attribution``); members already finished are
    skipped. Other arguments as in :func:`attribute` (the exact account by default, with each member's own readout
    set).
    """
    runs = [Run.open(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run dirs to attribute")
    index = member_indices(runs)
    for run in runs:
        if not run.done:
            raise ValueError(f"{run.dir} has not finished training; attribution replays a finished run")
    outs = list(out_dirs) if out_dirs is not None else [None] * len(runs)
    if len(outs) != len(runs):
        raise ValueError("give one output folder per run dir")
    readout = readout_size(reading, readout, min(run.cfg.n_eval for run in runs), runs[0].cfg.batch_size)
    sites = run_sites(runs[0], sites)
    check_features(runs[0], features)  # before the output folders are made
    outs = [ensure_writable_dir(run.attribution(o).dir) for o, run in zip(outs, runs)]
    if len({o.resolve() for o in outs}) < len(outs):
        raise ValueError("the members need distinct output folders")
    dev = resolve_device(device if device != "auto" else runs[0].cfg.device)
    run_axis = run_axis and runs[0].task.sample(1, np.random.default_rng(0)).feature_types is None
    with ExitStack() as locks:
        for o in outs:  # one writer per attribution folder
            locks.enter_context(DirLock(o, force=force_unlock))
        todo = [(r, m) for r, m in zip(index, (_Tracked(run, o, sites, features, dev, device, block, sgd_rows,
                                                        reading == "midpoint", run_axis, readout)
                                               for run, o in zip(runs, outs)))
                if not m.done]
        if todo:
            group = GroupReplay(runs[0], dev, runs)
            axis = None
            if run_axis:
                while len({m.start for _, m in todo}) > 1:  # one step for all: the later ones go back
                    first = min(m.start for _, m in todo)
                    for _, m in todo:
                        if m.start > first:
                            m.rewind(first)
                axis = RunAxisTracker([m.tracker for _, m in todo])
            first, steps = min(m.start for _, m in todo), runs[0].cfg.steps
            threads_at = locks.enter_context(follow_threads(runs[0].dir, dev))  # the group trained as one
            for step in progress_of(range(first, steps), initial=first, total=steps, enabled=progress,
                                    desc=f"attribute the group of {runs[0].name} ({len(todo)} runs)"):
                threads_at(step)
                active = [(r, m) for r, m in todo if m.start <= step]  # a member resumed later joins at its state
                for r, m in active:
                    if m.start == step:
                        group.join(r, m.model, m.opt)
                if axis is not None:
                    batches = [m.batch(step) for _, m in active]
                    stack, group_opt = group.state(step)
                    per_member = axis.track(stack, cast(torch.optim.Adam, group_opt), [r for r, _ in active],
                                            *(torch.stack(b) for b in zip(*batches)))
                    for (_, m), rows in zip(active, per_member):
                        m.record(rows)
                    group(step, export=any(m.boundary(step) for _, m in active))  # the members' models and Adams
                    # are read only at the block boundaries (resume points, the final check)
                else:
                    for _, m in active:
                        m.track(step)
                    group(step)
                for _, m in active:
                    m.end_step(step)
            for _, m in todo:
                m.finish()
    return outs


def influence_read_at(attribution_dirs: Sequence[str | Path]) -> str | None:
    """How the finished attributions in ``attribution_dirs`` read the influence: "exact" (the exact account on a
    readout set), "midpoint" (each step's batch, ∇R at its midpoint) or "start" (each step's batch, ∇R at θ_t: the
    paper's); None for no folders. Raises ValueError if they differ: one report reads one kind."""
    kinds = {spec_reading(read_json(AttributionDir(Path(d)).spec)) for d in attribution_dirs}
    if len(kinds) > 1:
        raise ValueError(f"these runs were replayed in different readings ({', '.join(sorted(kinds))}): "
                         + ", ".join(str(d) for d in attribution_dirs) + "; replay them all one way "
                         "(remove the attribution folders of the other kinds)")
    return next(iter(kinds), None)


def spec_reading(spec: dict) -> str:
    """An attribution's reading from its spec.json: "exact", "midpoint" or "start"."""
    return "exact" if spec.get("readout") else "midpoint" if spec.get("midpoint") else "start"


def run_sites(run: Run, sites: Sequence[Site]) -> list[Site]:
    """The distinct ``sites``, sorted, checked against the run's model (before anything is written); at least one."""
    sites = checked_sites(sites, run.model_config().n_layer, run.task.seq_len)
    if not sites:
        raise ValueError("no sites to attribute")
    return sites


def _replay(run: Run, out: Path, sites: list[Site], features, dev, device, block, progress, sgd_rows,
            midpoint, readout=None, extra=(), matrices=False) -> Path:
    m = _Tracked(run, out, sites, features, dev, device, block, sgd_rows, midpoint, readout=readout, extra=extra,
                 matrices=matrices)
    if m.done:
        return out
    advance = replay_stepper(run, m.model, m.opt, dev)  # a run group's member steps with its group
    alone = not run.in_group  # then track()'s backward is train_step's, bit for bit
    with follow_threads(run.dir, dev) as threads_at:
        for step in progress_of(range(m.start, run.cfg.steps), initial=m.start, total=run.cfg.steps,
                                enabled=progress, desc=f"attribute {run.name}"):
            threads_at(step)
            tokens, mask = m.track(step)
            if alone:
                m.tracker.optimizer_step(m.model, m.opt)
            else:
                advance(step, tokens, mask)
            m.end_step(step)
    m.finish()
    return out


class _Tracked:
    """One run's tracked replay: its model and Adam (at step ``start`` after resuming), its tracker, output folder
    and the rows of the block being written. Per step: ``track(step)`` before the update, ``end_step(step)`` after
    it; ``finish()`` at the end. ``done``: the folder already holds a finished attribution (nothing else is set)."""

    def __init__(self, run: Run, out: Path, sites: list[Site], features, dev, device, block, sgd_rows: bool,
                 midpoint: bool, run_axis: bool = False, readout: int | None = None, extra: Sequence[Probe] = (),
                 matrices: bool = False):
        cfg = run.cfg
        self.run, self.out, self.dev = run, out, dev
        self.annotate = _batch_types(run, readout)
        task_probes = make_probes(run, sites, features, device) if sites else []  # none: the directions only
        self.probes = task_probes + list(extra)
        spec = {"sites": [[s.layer, s.pos] for s in sites], "features": sorted({p.name for p in task_probes}),
                "config_hash": cfg.hash(), "sgd_rows": sgd_rows, "midpoint": midpoint, "run_axis": run_axis,
                "readout": readout, "directions": direction_records(extra), "matrices": matrices}
        folder = AttributionDir(out)
        old = {"sgd_rows": True, "midpoint": False, "run_axis": False, "readout": None, "directions": [],
               "matrices": False,
               **read_json(folder.spec)} if (
            folder.spec.exists()) else spec  # keys missing in specs written before they existed
        old["features"] = sorted(feature_name(f) for f in old["features"])  # toy names before 0.2
        self.done = folder.done
        if self.done and {**old, "run_axis": run_axis} == spec:
            spec = old  # finished either way: the spec keeps saying how
        if old != spec:
            if {**old, "midpoint": midpoint} == spec:
                what = f"read at each step's {'midpoint' if old['midpoint'] else 'start'}"
            elif {**old, "readout": readout} == spec:
                what = (f"with the exact account on a readout of {old['readout']}" if old["readout"]
                        else "read on each step's batch (without --readout)")
            elif {**old, "matrices": matrices} == spec:
                what = "with influence matrices" if old["matrices"] else "without influence matrices (--matrices)"
            elif {**old, "run_axis": run_axis} == spec:
                what = ("tracked over its group's run axis (resume it with attribute --group)" if old["run_axis"]
                        else "tracked one member at a time (resume it with attribute RUN_DIR, without --group)")
            elif {**old, "directions": spec["directions"]} == spec:
                what = "of other directions (names, sites or vectors: spec.json records each one's sha256)"
            else:
                what = "with other sites/features/rows"
            raise ValueError(f"{out} holds an attribution {what}; write to another folder (attribute --out) or "
                             "remove it")
        write_json(folder.spec, spec)
        folder.parts.mkdir(exist_ok=True)
        if self.done:
            return
        task = run.task
        train_set, self.eval_set = run.datasets()
        self.data = to_torch(train_set, dev)
        self.types = None
        self.type_index = {n: task.feature_names.index(n) for n in spec["features"]}
        if train_set.feature_types is not None:
            self.types = {n: torch.as_tensor(train_set.feature_types[..., i], device=dev).long()
                          for n, i in self.type_index.items()}
        self.tracker = InfluenceTracker(run.load_model("final", dev),
                                        [Probe(p.site, p.name, p.w.to(dev)) for p in self.probes], sgd_rows=sgd_rows,
                                        midpoint=midpoint)
        self.tracker.use_dataset(self.data["tokens"])  # θ* projections once per example, not a θ* forward per step
        self.readout = readout
        if readout is not None:
            held = torch.as_tensor(self.eval_set.tokens[:readout], device=dev)
            types = None if self.eval_set.feature_types is None else {
                n: torch.as_tensor(self.eval_set.feature_types[:readout, :, task.feature_names.index(n)],
                                   device=dev).long() for n in spec["features"]}
            self.tracker.use_readout(held, types, matrices=matrices)
        self.block = block or cfg.ckpt_every
        self.order = DataOrder(cfg.seed, cfg.n_train, cfg.batch_size)
        self.rewind(cfg.steps)

    def rewind(self, upto: int) -> None:
        """Load the newest resume point at or before step ``upto`` (none: start over from the initial weights)."""
        self.model = self.run.load_model("init", self.dev).train()
        self.opt = make_optimizer(self.model, self.run.cfg)
        self.tracker.load_state_dict({"step": torch.tensor(0)})
        self.start, self.cums = _resume(self.out, self.model, self.opt, self.tracker, self.dev, upto)
        self.rows: list[dict] = []
        self.block_start = self.start

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``step``'s batch: tokens, loss_mask [batch, pos] and their rows in the training set [batch]."""
        i = self.order(step).to(self.dev)
        return self.data["tokens"][i], self.data["loss_mask"][i], i

    def track(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Track ``step`` (before its update); returns its batch: tokens, loss_mask [batch, pos]."""
        tokens, mask, i = self.batch(step)
        types = None if self.types is None else {k: v[i] for k, v in self.types.items()}
        if self.annotate is not None:  # a token-only training set: the batch's types from its tokens
            ft = torch.as_tensor(self.annotate(tokens.cpu().numpy()).feature_types, device=self.dev).long()
            types = {n: ft[..., j] for n, j in self.type_index.items()}
        self.record(self.tracker.track(self.model, self.opt, tokens, mask, types, example_ids=i))
        return tokens, mask

    def record(self, rows: list[dict]) -> None:
        """Add a step's rows (from this member's tracker) to the block, with their running sums."""
        for r in rows:
            key = tuple(r[k] for k in KEY)
            self.cums[key] += r["value"] if r["component"] != "risk" else 0.0
            r["cumulative"] = self.cums[key] if r["component"] != "risk" else r["value"]
            self.rows.append(r)

    def boundary(self, step: int) -> bool:
        """Whether ``step`` ends a block (its ``end_step`` writes the rows and a resume point)."""
        return (step + 1) % self.block == 0 or step + 1 == self.run.cfg.steps

    def end_step(self, step: int) -> None:
        """After ``step``'s update: at a block boundary, write the block's rows and a resume point."""
        if self.boundary(step):
            _write_part(AttributionDir(self.out).part(self.block_start), self.rows)
            self.rows, self.block_start = [], step + 1
            save_resume_point(self.out, self.model, self.opt, step + 1,
                              {f"tracker.{k}": v for k, v in self.tracker.state_dict().items()})

    def finish(self) -> None:
        """Check the final weights against the run's (bit for bit) and write influence.parquet and summary.json."""
        check_replay(self.run, self.model)
        if self.tracker.matrices is not None:  # before influence.parquet, which marks the folder done
            save_matrices(self.out, self.tracker, {"readout": self.readout, "steps": self.run.cfg.steps,
                                                   "config_hash": self.run.cfg.hash(),
                                                   "optimizer": self.run.cfg.own_rows})
        _finish(self.out, self.run, self.probes, self.tracker.final_model, self.eval_set, self.dev, self.readout,
                None if self.readout is None else exact_notes(self.tracker))


def _batch_types(run: Run, readout: int | None):
    """How a replay in a batch reading (no readout) labels each step's batch when the run's training set holds tokens only (its
    feature types kept on the evaluation set, as Othello's): the task's ``annotate`` (tokens [n, T] -> Batch); None
    when the training set has its types or a readout reads the types of its own set. ValueError (one line) for a
    task that cannot annotate."""
    train_set, eval_set = run.datasets()
    if readout is not None or train_set.feature_types is not None or eval_set.feature_types is None:
        return None
    annotate = getattr(run.task, "annotate", None)
    if not callable(annotate):
        raise ValueError(f"{run.dir}'s training set holds tokens only, its feature types are on the evaluation set: "
                         "per-type rows need the exact account's readout (attribute's default reading)")
    return cast(Callable[[np.ndarray], Batch], annotate)


def resume_points(out: Path) -> Checkpoints:
    """The replay's resume points in ``out``: checkpoints of ``state/`` in the run's format (model, Adam and the
    replay's own tensors as extras), so a torn write is never read and a corrupt one falls back to the one before."""
    return Checkpoints(AttributionDir(out).states)


def save_resume_point(out: Path, model, opt, step: int, extra: dict[str, torch.Tensor]) -> None:
    """Save the resume point of ``step`` in ``out`` (model, Adam and ``extra`` tensors). Keeps this one and the one
    before (the fallback if this one rots)."""
    points = resume_points(out)
    points.save(step, model, opt, extra=extra)
    fault_point("attribute:after_checkpoint")
    points.prune(keep=2)


def _resume(out: Path, model, opt, tracker, dev, upto: int | None = None):
    cums: dict[tuple, float] = defaultdict(float)
    start, state = resume_points(out).load_latest(model, opt, dev, upto)
    parts = AttributionDir(out).part_files()
    if not start:
        for p in parts:
            p.unlink()
        return 0, cums

    tracker.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("tracker.")})
    for p in parts:
        if int(p.stem.split("_")[1]) >= start:
            p.unlink()  # written after the saved state: recomputed
            continue
        t = pq.read_table(p).to_pydict()
        for j in range(len(t["step"])):
            cums[tuple(t[k][j] for k in KEY)] = t["cumulative"][j]
    log.info("resuming attribution in %s from step %d", out, start)
    return start, cums


def _write_part(path: Path, rows: list[dict]):
    table = pa.Table.from_pylist(rows)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def check_replay(run: Run, model):
    final = run.weights("final")
    worst = 0.0
    for k, v in model.state_dict().items():
        ref = final[k]
        if not torch.equal(v.cpu(), ref):
            worst = max(worst, (v.cpu() - ref).abs().max().item())
    if worst:
        raise RuntimeError(f"replay diverged from the training run of {run.dir} (max |Δθ| = {worst:.3g}); "
                           "its influences would not describe that run")


def exact_notes(tracker: InfluenceTracker) -> dict:
    """The exact account's counters and rule (summary.json) of a replay's tracker."""
    ro = tracker.exact_readout
    return {"refined_steps": tracker.refined, "subdivided_steps": tracker.subdivided,
            "point_evaluations": tracker.evaluations,
            "rule": f"Gauss-Legendre {'/'.join(map(str, ro.levels))} points, then the step split into "
                    f"{'/'.join(map(str, ro.pieces)) or 'no'} pieces of {ro.levels[-1]} points each, a step "
                    f"re-integrated while |residual| > min({ro.rtol:g} |change|, {ro.cap:g} R_H(θ_0)) + "
                    f"{ro.floor:g} R_H(θ_0), each split after the first kept only if it cuts the worst excess by "
                    f"{ro.stall:g}"}


def _finish(out: Path, run: Run, probes, final_model, eval_set, dev, readout: int | None = None,
            exact: dict | None = None):
    """Write influence.parquet (the parts' rows, self-describing) and summary.json; log the closing lines.
    ``exact``: the exact account's counters and rule (:func:`exact_notes`), with ``readout``."""
    folder = AttributionDir(out)
    parts = folder.part_files()
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    for name, value, kind in (("task", run.cfg.task, pa.string()), ("regime", run.cfg.regime, pa.string()),
                              ("seed", run.cfg.seed, pa.int64())):  # self-describing rows: tables of runs combine
        table = table.append_column(name, pa.array([value] * table.num_rows, kind))
    flags = {(p.site.pos, p.name): useful_flag(run.task, p.site.pos, p.name) for p in probes}
    table = table.append_column("useful", pa.array([flags.get((pos, f)) for pos, f in zip(
        table["pos"].to_pylist(), table["feature"].to_pylist())], pa.bool_()))
    tmp = folder.influence.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    # mismatch actually removed, on a fixed held-out batch (the readout set, if any): R(θ_0) − R(θ_T) = R(θ_0), since
    # θ_T is θ* (the replay was checked bit for bit against the final weights before this)
    tokens = torch.as_tensor(eval_set.tokens[:readout or 1024], device=dev)
    with torch.no_grad():
        r_star = final_model(tokens, return_resid=True, myopic="none")[1]
        r0 = run.load_model("init", dev)(tokens, return_resid=True, myopic="none")[1]
    last = table.filter(pc.equal(table["step"], pc.max(table["step"]))).to_pylist()  # pyright: ignore[reportAttributeAccessIssue]  # pyarrow.compute's functions are generated at import, not in its stubs
    steps, own = step_kappas(table), run.cfg.own_rows
    summary = []
    for p in probes:
        k, i = p.site.layer, p.site.pos
        w = p.w.to(dev)
        d0 = (r0[k][:, i] - r_star[k][:, i]) @ w  # [batch]
        for mismatch in MISMATCHES:
            R0 = mismatch_value(d0, mismatch).item()
            entry = {"layer": k, "pos": i, "feature": p.name, "mismatch": mismatch, "useful": flags[(i, p.name)],
                     "R0_eval": R0,
                     "R0_minus_RT_eval": R0, "offset_share_R0": (d0.mean().pow(2) / d0.pow(2).mean()).item()}
            for r in last:
                if (r["layer"], r["pos"], r["feature"], r["feature_type"], r["mismatch"]) != (k, i, p.name, -1, mismatch):
                    continue
                if r["component"] in ("change", "residual"):  # readout: Σ exact changes, Σ residuals
                    entry[r["component"]] = r["cumulative"]
                elif r["component"] != "risk":
                    entry[f"{r['optimizer']}_{r['component']}"] = r["cumulative"]
            entry.update(condition(entry, steps, (k, i, p.name, -1, mismatch), own))
            entry["shares"] = shares(entry, own)
            summary.append(entry)
    extra = {} if readout is None else {
        "readout": readout, **(exact or {}),
        "exact": "R0_eval = R_H(θ_0) and R0_minus_RT_eval on the readout set; change = Σ_t R_H(θ_t) − R_H(θ_t+1); "
                 "residual = Σ_t (full influence − change)"}
    write_json(folder.summary, {"probes": summary, "steps": run.cfg.steps, "own_rows": own, **extra,
                                "conditioning": "kappa_o = (|o_direct| + |o_pre_cached| + |o_shared|) / |o_full| "
                                                "of reading o; kappa_steps_o the same summed over the steps' own "
                                                "values; signs_agree: the run's own reading and sgd per component",
                                "stamp": stamp(),
                                      "sign": "positive = the component moved the feature toward its final value"})
    tmp.replace(folder.influence)
    what = (f"{run.name}: attributed {len({p.site for p in probes})} sites × {len({p.name for p in probes})} features over "
            f"{run.cfg.steps} steps")
    if readout is None:
        log.info(f"{what}; {_balance_text(summary, own)}")
        for line in conditioning_lines(summary, own):
            log.info(f"{run.name}: {line}")
        return
    exact = exact or {}
    log.info(f"{what} with the exact account on a readout of {readout}"
             f"{' (kept while training: no replay)' if exact.get('account') else ''}; {exact['refined_steps']}/"
             f"{run.cfg.steps} steps refined ({exact['subdivided_steps']} split into pieces); "
             f"{_balance_text(summary, own, 'change')}")
    for line in residual_lines(summary) + conditioning_lines(summary, own):
        log.info(f"{run.name}: {line}")


def residual_lines(summary: list[dict], limit: float = 0.01) -> list[str]:
    """One line per mismatch of an exact account: the largest |residual| / R_H(θ_0) over its rows and PASS/FAIL
    against ``limit`` (the influence claims' precondition), as :func:`residual_share` decides it: a row with
    R_H(θ_0) = 0 and no residual (a feature constant on the readout) has nothing to split and is counted aside; one
    with R_H(θ_0) = 0 but a residual fails."""
    lines = []
    for mismatch in MISMATCHES:
        rows = [e for e in summary if e["mismatch"] == mismatch]
        share = residual_share(rows)
        if share is None:
            continue
        worst, zero = share["worst"], share["zero_R0"]
        ok = zero == 0 and worst is not None and worst <= limit
        empty = sum(1 for e in rows if e.get("residual") == 0 and e.get("R0_eval") == 0)
        notes = ([f"{zero} rows with R_H(θ_0) = 0 but a residual"] if zero else []) + (
            [f"{empty} rows with R_H(θ_0) = 0 and no residual, nothing to split"] if empty else [])
        lines.append(f"exact account, {mismatch}: largest |residual| / R_H(θ_0) "
                     f"{'n/a' if worst is None else f'{worst:.2e}'} {'PASS' if ok else 'FAIL'} (≤ {limit:g})"
                     + (f"; {'; '.join(notes)}" if notes else ""))
    return lines


def residual_share(records) -> dict | None:
    """The exact account's check over ``records`` (attribution summary rows with ``residual`` = Σ_t (full influence −
    exact change) and ``R0_eval`` = R_H(θ_0)): ``{"worst": the largest |residual| / R_H(θ_0), "n": rows, "zero_R0":
    rows with R_H(θ_0) = 0 and a non-zero residual}``; None when no row has a residual (the paper's reading)."""
    rows = [r for r in records if r.get("residual") is not None and r.get("R0_eval") is not None]
    if not rows:
        return None
    ratios = [abs(r["residual"]) / r["R0_eval"] for r in rows if r["R0_eval"] > 0]
    return {"worst": max(ratios, default=None), "n": len(rows),
            "zero_R0": sum(1 for r in rows if r["R0_eval"] <= 0 and r["residual"] != 0)}


def _balance_text(summary: list[dict], own: str = "adam", removed: str = "R0_minus_RT_eval") -> str:
    """The balance check: the integrated full influence of the run's own reading against the mismatch removed,
    R(θ_0) − R(θ_T) on held-out data (the paper's readings: equal to first order only) or the summed exact changes
    (``removed="change"``: equal up to the residual), as a median over the probes."""
    ratios = sorted(e[f"{own}_full"] / e[removed] for e in summary
                    if e["mismatch"] == "paper" and f"{own}_full" in e and e.get(removed))
    what = "R(θ_0) − R(θ_T) on held-out data" if removed == "R0_minus_RT_eval" else "the exact change"
    return (f"integrated full influence / ({what}): median {ratios[len(ratios) // 2]:.3g} over {len(ratios)} probes "
            f"(1 = balanced)" if ratios else "balance check: no probe with a nonzero mismatch removed")
