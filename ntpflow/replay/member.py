"""One run's tracked replay: its model, optimizer and tracker from the run's initial weights (or its last resume
point), the rows of each block of steps, the resume points, and the check that the replay ends in the run's final
weights bit for bit (``ntpflow.replay.attribution.attribute`` starts it)."""

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ntpflow.engine.exact import chunk_matrices
from ntpflow.engine.influence import InfluenceTracker, Probe
from ntpflow.engine.replay_account import ReplayAccount
from ntpflow.files import (
    fault_point,
    read_json,
    write_json,
)
from ntpflow.model.sites import Site, feature_name
from ntpflow.progress import progress_of
from ntpflow.replay.directions import direction_records
from ntpflow.replay.from_account import account_rows, matrices_layout
from ntpflow.replay.matrices import save_matrices
from ntpflow.replay.summary import exact_notes, write_summary
from ntpflow.replay.tracked import make_probes
from ntpflow.runs.data import DataOrder, to_torch
from ntpflow.runs.group import replay_stepper
from ntpflow.runs.run import AttributionDir, Checkpoints, Run
from ntpflow.runs.threads import follow_threads
from ntpflow.runs.training import make_optimizer
from ntpflow.tasks import Batch

log = logging.getLogger(__name__)
KEY = ("layer", "pos", "feature", "feature_type", "mismatch", "component", "optimizer")


def replay_member(run: Run, out: Path, sites: list[Site], features, dev, device, block, progress, sgd_rows,
            midpoint, readout=None, extra=(), matrices=False) -> Path:
    m = MemberReplay(run, out, sites, features, dev, device, block, sgd_rows, midpoint, readout=readout, extra=extra,
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
                m.take_step()
            else:
                advance(step, tokens, mask)
            m.end_step(step)
    m.finish()
    return out


class MemberReplay:
    """One run's tracked replay: its model and optimizer (at step ``start`` after resuming), what tracks it, output
    folder and the rows of the block being written. Per step: ``track(step)`` before the update (then ``take_step()``
    for a run trained alone), ``end_step(step)`` after it; ``finish()`` at the end. ``done``: the folder already holds
    a finished attribution (nothing else is set).

    The exact reading is its :class:`ReplayAccount` (``account``: the account kept while training, judged by the
    probes' risks; rows and matrices from its one-step chunks), alone or over a group's run axis; the batch readings
    are an ``InfluenceTracker``'s (``tracker``). ``tracking``: whichever of the two it has."""

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
        self.final_model = run.load_model("final", dev)
        probes = [Probe(p.site, p.name, p.w.to(dev)) for p in self.probes]
        self.readout, self.sgd_rows, self.matrices = readout, sgd_rows, matrices
        self.tracker: InfluenceTracker | None = None
        self.held: torch.Tensor | None = None  # the exact account's readout set [N, pos]
        if readout is None:
            self.tracker = InfluenceTracker(self.final_model, probes, sgd_rows=sgd_rows, midpoint=midpoint)
            self.tracker.use_dataset(self.data["tokens"])  # θ* projections once per example, not a θ* forward a step
        else:
            self.held, self.probes_on = torch.as_tensor(self.eval_set.tokens[:readout], device=dev), probes
            self.held_types = None if self.eval_set.feature_types is None else {
                n: torch.as_tensor(self.eval_set.feature_types[:readout, :, task.feature_names.index(n)],
                                   device=dev).long() for n in spec["features"]}
            with torch.no_grad():
                resid = self.final_model(self.held, return_resid=True, myopic="none")[1]
            self.r_star = {p.site: resid[p.site.layer][:, p.site.pos] for p in probes}  # θ*'s [N, d]
        self.block = block or cfg.ckpt_every
        self.order = DataOrder(cfg.seed, cfg.n_train, cfg.batch_size)
        self.rewind(cfg.steps)

    def rewind(self, upto: int) -> None:
        """Load the newest resume point at or before step ``upto`` (none: start over from the initial weights)."""
        self.model = self.run.load_model("init", self.dev).train()
        self.opt = make_optimizer(self.model, self.run.cfg)
        self.account: ReplayAccount | None = None
        if self.held is not None:
            self.account = ReplayAccount(self.model, self.opt, self.probes_on, self.held, self.r_star,
                                         sgd_rows=self.sgd_rows, types=self.held_types, on_chunk=self._on_chunk)
            sites = self.account.sites
            d = self.model.cfg.d_model
            self.totals = {s: torch.zeros((2, len(self.account.names), d, d), dtype=torch.float64,
                                          device=self.dev) for s in sites} if self.matrices else {}
            self.start_resid: dict[Site, torch.Tensor] = {}
        self.tracking.load_state_dict({"step": torch.tensor(0)})
        self.start, self.cums, state = _resume(self.out, self.model, self.opt, self.tracking, self.dev, upto)
        if self.account is not None and self.start and "tracker.replay.risk0" not in state:
            log.info("%s: a resume point of an earlier ntpflow's exact replay (not its account): starting over",
                     self.out)
            return self.rewind(0)
        if self.account is not None and self.matrices and self.start:
            for s in self.account.sites:
                self.totals[s] = state[f"matrices.total.{s.layer}:{s.pos}"]
                self.start_resid[s] = state[f"matrices.start.{s.layer}:{s.pos}"]
        self.rows: list[dict] = []
        self.block_start = self.start

    @property
    def tracking(self) -> InfluenceTracker:
        """What tracks the replay: its account (the exact reading), else its tracker."""
        tracking = self.account if self.account is not None else self.tracker
        assert tracking is not None
        return tracking

    def _on_chunk(self, first: int, tensors: dict[str, torch.Tensor]) -> None:
        """The account's chunk of one step: its rows (and its matrices' share)."""
        assert self.account is not None
        self.record(account_rows([(first, tensors)], self.r_star, self.account.own, self.account.names,
                                 self.probes_on, self.held_types))
        for s in self.totals:
            self.totals[s] += chunk_matrices(tensors, s, self.r_star[s])
            if first == 0:
                self.start_resid[s] = tensors[f"start.{s.layer}:{s.pos}"]

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
        if self.account is not None:  # the rows arrive through _on_chunk
            self._passes = self.account.account_step(tokens, mask)
        else:
            assert self.tracker is not None
            self.record(self.tracker.track(self.model, self.opt, tokens, mask, types, example_ids=i))
        return tokens, mask

    def take_step(self) -> None:
        """The training step of the batch just tracked, on the gradients of its tracking (the training's bits)."""
        if self.account is not None:
            self.account.optimizer_step(self._passes)
        else:
            assert self.tracker is not None
            self.tracker.optimizer_step(self.model, self.opt)

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
            write_part(AttributionDir(self.out).part(self.block_start), self.rows)
            self.rows, self.block_start = [], step + 1
            extra = {f"tracker.{k}": v for k, v in self.tracking.state_dict().items()}
            for s, total in self.totals.items() if self.account is not None else ():
                extra[f"matrices.total.{s.layer}:{s.pos}"] = total
                extra[f"matrices.start.{s.layer}:{s.pos}"] = self.start_resid[s]
            save_resume_point(self.out, self.model, self.opt, step + 1, extra)

    def finish(self) -> None:
        """Check the final weights against the run's (bit for bit) and write influence.parquet and summary.json."""
        check_replay(self.run, self.model)
        notes = None
        if self.account is not None:
            if self.matrices:  # before influence.parquet, which marks the folder done
                save_matrices(self.out, matrices_layout(self.totals, self.start_resid, self.r_star, self.account.own,
                                                        self.account.names),
                              {"readout": self.readout, "steps": self.run.cfg.steps,
                               "config_hash": self.run.cfg.hash(), "optimizer": self.account.own})
            notes = exact_notes(self.account, self.account.rule)
        write_summary(self.out, self.run, self.probes, self.final_model, self.eval_set, self.dev, self.readout, notes)


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
        return 0, cums, state

    tracker.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("tracker.")})
    for p in parts:
        if int(p.stem.split("_")[1]) >= start:
            p.unlink()  # written after the saved state: recomputed
            continue
        t = pq.read_table(p).to_pydict()
        for j in range(len(t["step"])):
            cums[tuple(t[k][j] for k in KEY)] = t["cumulative"][j]
    log.info("resuming attribution in %s from step %d", out, start)
    return start, cums, state


def write_part(path: Path, rows: list[dict]):
    """Write ``rows`` to the parquet file ``path`` atomically (a temporary file, then a rename)."""
    table = pa.Table.from_pylist(rows)
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def check_replay(run: Run, model):
    """RuntimeError (one line) unless the replayed ``model`` holds the run's final weights bit for bit."""
    final = run.weights("final")
    worst = 0.0
    for k, v in model.state_dict().items():
        ref = final[k]
        if not torch.equal(v.cpu(), ref):
            worst = max(worst, (v.cpu() - ref).abs().max().item())
    if worst:
        raise RuntimeError(f"replay diverged from the training run of {run.dir} (max |Δθ| = {worst:.3g}); "
                           "its influences would not describe that run")


