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

This module holds the entry points (``attribute``, ``attribute_group``, the readings); one run's replay is
``ntpflow.replay.member``, what it tracks ``ntpflow.replay.tracked``, the closing files ``ntpflow.replay.summary``,
and a run trained with the account is read by ``ntpflow.replay.from_account`` instead of being replayed.
"""

import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import cast

import numpy as np
import torch

from ntpflow.engine.influence import Probe
from ntpflow.engine.run_axis import RunAxisTracker
from ntpflow.files import (
    DirLock,
    ensure_writable_dir,
    read_json,
    resolve_device,
    write_json,
)
from ntpflow.model.sites import Site, feature_name
from ntpflow.progress import progress_of
from ntpflow.replay.directions import direction_probes, direction_records
from ntpflow.replay.from_account import account_rows, rule_text, save_account_matrices
from ntpflow.replay.member import MemberReplay, replay_member, write_part
from ntpflow.replay.spec import AttributionSpec
from ntpflow.replay.summary import write_summary
from ntpflow.replay.tracked import check_features, make_probes, run_sites
from ntpflow.runs.account import KeptAccount, read_account
from ntpflow.runs.group import GroupReplay, member_indices
from ntpflow.runs.run import AttributionDir, Run
from ntpflow.runs.threads import follow_threads

log = logging.getLogger(__name__)


def attribute(run_dir: str | Path, spec: AttributionSpec, *, out_dir: str | Path | None = None, device: str = "auto",
              progress: bool = True, force_unlock: bool = False) -> Path:
    """Replay the run at ``run_dir`` with influence tracking as ``spec`` says (:class:`AttributionSpec`: sites ×
    features, directions, reading, readout, ...); returns the output dir (``out_dir``, default RUN_DIR/attribution).

    A run trained with the account (``train --account``) is not replayed: its exact account is read from
    ``RUN_DIR/account`` when it covers the sites (and the spec's readout, if given, is its own), for any features and
    directions (``ntpflow.replay.from_account``); ``spec.replay`` replays it all the same.

    The replay must reproduce the run's final weights bit for bit, else it raises RuntimeError. It resumes from
    its last saved state when interrupted (every ``spec.block`` steps, default the run's ``ckpt_every``).
    ``force_unlock`` takes over a lock left by a process on another host. ``spec.sgd_rows=False`` writes the
    optimizer's rows only (about 30 % less tracking work at the toy load). With the exact reading summary.json gives
    every row's residual; ``spec.matrices`` also saves every site's influence matrices, from which any direction's
    influence can be read afterwards (``ntpflow.replay.matrices.direction_influence``, ``ntpflow discover``).
    """
    run = Run.open(run_dir)
    if not run.done:
        raise ValueError(f"{run_dir} has not finished training; attribution replays a finished run")
    cfg = run.cfg
    readout = spec.readout_size(cfg.n_eval, cfg.batch_size)  # checked before the account is read
    dev = resolve_device(device if device != "auto" else cfg.device)
    sites = run_sites(run, spec.sites) if spec.sites or not spec.directions else []
    mc = run.model_config()
    extra = direction_probes(spec.directions, mc.n_layer, run.task.seq_len, mc.d_model, run.task.feature_names)
    features = None if spec.features is None else list(spec.features)
    kept = covering_account(run, spec, sites, extra, features)
    if sites:
        check_features(run, features)  # before the output folder is made
    out = ensure_writable_dir(run.attribution(out_dir).dir)
    with DirLock(out, force=force_unlock):  # one writer per attribution folder
        if kept is not None:
            return _from_account(run, kept, out, sites, features, dev, device, extra, spec.matrices)
        return replay_member(run, out, sites, features, dev, device, spec.block, progress, spec.sgd_rows,
                             spec.reading == "midpoint", readout, extra, spec.matrices)


def covering_account(run: Run, spec: AttributionSpec, sites: Sequence[Site], extra: Sequence[Probe],
                     features: Sequence[str] | None) -> KeptAccount | None:
    """The run's finished account if it answers ``spec`` at ``sites`` for ``features`` (None: all the task's) and
    the directions ``extra`` without a replay: the exact reading, not ``spec.replay``, every site kept, the spec's
    readout (if given) the account's, and the per-type rows of a task that labels its features by type; None
    otherwise (the run is replayed; a kept account that does not cover says why in the log)."""
    kept = None if spec.reading != "exact" or spec.replay else read_account(run)
    if kept is None:
        return None
    if not ({*sites, *(p.site for p in extra)} <= set(kept.sites) and spec.readout in (None, kept.spec["readout"])):
        log.info("%s's account (sites %s, readout %d) does not cover this attribution: replaying the run", run.dir,
                 ", ".join(f"{s.layer}:{s.pos}" for s in kept.sites), kept.spec["readout"])
        return None
    typed = [] if not sites or run.datasets()[1].feature_types is None else [
        f for f in (feature_name(f) for f in features or run.task.feature_names) if f not in kept.types]
    if typed:
        log.info("%s's task labels its features by type (e.g. Othello's squares) and its account keeps no per-type "
                 "rows of %s (train --account-types): replaying the run", run.dir, ", ".join(typed[:5])
                 + (f" and {len(typed) - 5} more" if len(typed) > 5 else ""))
        return None
    return kept


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
    write_part(folder.part(0), account_rows(kept.chunks(), kept.final, kept.meta["own"], kept.rows, probes,
                                             kept.types))
    if matrices:  # before influence.parquet, which marks the folder done
        save_account_matrices(out, kept, {"readout": kept.spec["readout"], "steps": run.cfg.steps,
                                          "config_hash": run.cfg.hash(), "optimizer": kept.meta["own"]})
    _, eval_set = run.datasets()
    notes = {k: kept.meta[k] for k in ("refined_steps", "subdivided_steps", "point_evaluations")}
    write_summary(out, run, probes, run.load_model("final", dev), eval_set, dev, kept.spec["readout"],
            {**notes, "rule": rule_text(kept.meta), "account": True, "chunk_steps": kept.spec["chunk_steps"]})
    return out


def attribute_group(run_dirs: Sequence[str | Path], spec: AttributionSpec, *,
                    out_dirs: Sequence[str | Path | None] | None = None, device: str = "auto", progress: bool = True,
                    force_unlock: bool = False, run_axis: bool = True) -> list[Path]:
    """Replay members of one run group together, tracking each as ``spec`` says; returns the output dirs.

    One pass over the steps: before each step the members are tracked, then the group takes the step once for all
    (``GroupReplay``). With ``run_axis`` (the default, for tasks without feature types) the members are tracked in
    one vmapped pass over the run axis (``ntpflow.engine.run_axis``): their values agree with :func:`attribute`'s to
    rounding, and all members resume from one step (a member saved later goes back to its previous resume
    point). Without it, each member's tracker runs on its own model and Adam, one after another, and each folder
    comes out bit for bit as :func:`attribute` writes it; members resume from their own last saved state. Each
    member writes to its own folder (``out_dirs``, default ``RUN_DIR/attribution``); members already finished are
    skipped. The spec's sites, features, reading, readout, sgd_rows and block apply (the exact account by default,
    with each member's own readout set); directions, matrices and replay are for :func:`attribute` (one run).
    A member trained with the account (``train_group(..., accounts=...)``) that covers the spec is read from it, as
    :func:`attribute` reads one, and the others are replayed.
    """
    spec.check_group()
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
    readout = spec.readout_size(min(run.cfg.n_eval for run in runs), runs[0].cfg.batch_size)
    sites = run_sites(runs[0], spec.sites)
    features = None if spec.features is None else list(spec.features)
    check_features(runs[0], features)  # before the output folders are made
    outs = [ensure_writable_dir(run.attribution(o).dir) for o, run in zip(outs, runs)]
    if len({o.resolve() for o in outs}) < len(outs):
        raise ValueError("the members need distinct output folders")
    dev = resolve_device(device if device != "auto" else runs[0].cfg.device)
    run_axis = run_axis and runs[0].task.sample(1, np.random.default_rng(0)).feature_types is None
    kept = [covering_account(run, spec, sites, (), features) for run in runs]
    with ExitStack() as locks:
        for o in outs:  # one writer per attribution folder
            locks.enter_context(DirLock(o, force=force_unlock))
        for run, o, account in zip(runs, outs, kept):  # members trained with the account: read, not replayed
            if account is not None:
                _from_account(run, account, o, sites, features, dev, device, (), False)
        replays = [(r, MemberReplay(run, o, sites, features, dev, device, spec.block, spec.sgd_rows,
                                    spec.reading == "midpoint", run_axis, readout))
                   for r, run, o, account in zip(index, runs, outs, kept) if account is None]
        todo = [(r, m) for r, m in replays if not m.done]
        if todo:
            group = GroupReplay(runs[0], dev, runs)
            axis = None
            if run_axis:
                while len({m.start for _, m in todo}) > 1:  # one step for all: the later ones go back
                    first = min(m.start for _, m in todo)
                    for _, m in todo:
                        if m.start > first:
                            m.rewind(first)
                axis = RunAxisTracker([m.tracking for _, m in todo])
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


