"""The OthelloGPT reproduction (docs/paper.md#othello, claim 3): world-model probes, where useful and useless squares
come from, and the fragility test.

``run_othello(scale, out)`` runs these stages into ``out`` (its layout: :class:`OthelloOut`; each stage resumable and
skipped when done):

1. train one vanilla OthelloGPT into ``out/run`` (``ntpflow.runs.training.train``);
2. ridge probes of the board's squares for the final and the step-0 weights (``RUN_DIR/probes``, ``RUN_DIR/probes_init``);
3. the 3-way least-squares classifier (empty / own / opponent) for both weights
   (``RUN_DIR/classifier_{final,init}.safetensors`` + ``.json``, see ``othello_probes``);
4. the fragility test: a myopic run of the same config and seed (``out/myopic/run``), its final ridge probes, and
   ``othello_fragility.run_fragility`` on both runs (``out/fragility``);
5. attribution: a replay of the run tracking the Adam/SGD influence of each gradient component on the tracked
   squares at the tracked sites, with per-type risks (``RUN_DIR/attribution``, see ``ntpflow.replay.attribution``);
6. gather into ``out/data.json`` (schema in ``othello_report``), then ``othello_report.write_report(out)``.

Conventions: ``resid[0]`` = embeddings, ``resid[k]`` = output of block ``k`` (``k = 1..n_layer``; the last one before
the final LayerNorm); a site ⟨k, p⟩ is ``resid[k]`` at position ``p``, the state after reading token ``p`` (move
``p`` of the game; position 0 is ``<bos>``). Logits at ``p`` predict token ``p + 1``. Square features ``sq_A1..sq_H8``
are the board from the view of the player to move next (+1 own, −1 opponent, 0 empty); their per-example type is
0 empty, 1 NTP-useless, 2 NTP-useful.

Stage wall times and CPU times (of the process that did the stage's work; only of stages that did work in a call) are
accumulated in ``out/timings.json``: ``{stage: wall seconds, "cpu_s": {stage: CPU seconds}, "steps": {training
stage: steps it timed}}`` (a call cut off loses its record, so a resumed training times only its own steps). With
``workers`` ≥ 2 the two training runs (stages 1 and 4) train side by side, each in its own worker process on the
scale's threads, so each run's bits are those of training it alone.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import pyarrow.compute as pc
import pyarrow.parquet as pq

from ntpflow.experiments.othello_fragility import FRAGILITY_JSON, run_fragility
from ntpflow.experiments.othello_probes import ClassifierProbes, load_or_classify
from ntpflow.experiments.othello_report import write_report
from ntpflow.experiments.parallel import gpu_count, on_threads, run_jobs, train_with_workers
from ntpflow.experiments.scales import resolve_scale, site_grid
from ntpflow.files import InFolder, ensure_writable_dir, read_json, resolve_device, write_json
from ntpflow.model.sites import Site
from ntpflow.probes import ProbeSet
from ntpflow.replay.attribution import attribute, influence_read_at
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import AccountSpec, account_for
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import AttributionDir, Run
from ntpflow.runs.training import train
from ntpflow.tasks.othello_engine import SQUARE_NAMES

log = logging.getLogger(__name__)

#: the 16 central squares (rows and columns 2–5, 0-based): C3..F6
CENTRAL_SQUARES = tuple(f"sq_{SQUARE_NAMES[8 * r + c]}" for r in range(2, 6) for c in range(2, 6))
TYPE_NAMES = {-1: "all", 0: "empty", 1: "useless", 2: "useful"}
SEED = 0


@dataclass(frozen=True)
class OthelloScale:
    """One scale: TrainConfig overrides (task othello, vanilla, seed 0), the tracked sites and squares.

    ``threads``: torch intra-op threads during the call (None: leave as is); ``curve_every``: step stride of the
    cumulative-influence curves in data.json; ``readout``: the replay's exact account on the first ``readout``
    evaluation games (``attribute(readout=...)``; None: read on each step's batch, at its midpoint by default);
    ``fragility``: keyword arguments of ``othello_fragility.run_fragility`` (its defaults where absent); ``pilots``:
    the folder of the pilots that chose the scale, relative to the committed report (docs/results/othello-<scale>/),
    which the report links to ("": none); ``account_chunks``: the chunks of steps the vanilla run's account keeps
    (its per-type accumulators of every square make each chunk large: 16 squares × 3 types × 2 × 6 rows × d² float64
    per site, 75 MiB at d = 128).
    """

    name: str
    train: dict
    sites: tuple[Site, ...]
    squares: tuple[str, ...] = CENTRAL_SQUARES
    threads: int | None = None
    curve_every: int = 10
    note: str = ""
    readout: int | None = None
    fragility: dict = field(default_factory=dict)
    pilots: str = ""
    account_chunks: int = 10

    def config(self, device: str = "auto", regime: Literal["vanilla", "myopic"] = "vanilla") -> TrainConfig:
        """The TrainConfig of this scale's run in ``regime`` (vanilla: the main run; myopic: the fragility test's
        comparison), seed ``SEED``, on ``device``."""
        return TrainConfig(task="othello", regime=regime, seed=SEED, device=device, **self.train)


@dataclass(frozen=True)
class OthelloOut:
    """The results folder of :func:`run_othello`, the only code that names a path in it::

        run/   (the vanilla run)   myopic/run/   (the myopic run of the fragility test)   fragility/   (its output)
        timings.json   data.json   (then the report's files: report.md, report.html, summary.json, figures/)
    """

    dir: Path

    run_dir = InFolder("run")
    myopic_dir = InFolder("myopic/run")
    fragility_dir = InFolder("fragility")
    timings = InFolder("timings.json")
    data = InFolder("data.json")

    @property
    def fragility(self) -> Path:
        """The fragility test's result file (``othello_fragility.FRAGILITY_JSON`` in ``fragility/``)."""
        return self.fragility_dir / FRAGILITY_JSON


PAPER_POSITIONS = tuple(range(4, 57, 4))  # 4, 8, ..., 56
SIX_STEPS = 12_000  # scale medium-6x6's steps, from the 6x6 pilot (see the scale)

SCALES = {
    # the paper (docs/paper.md#othello): 6 layers, d 256, 4 heads, batch 1024, 5000 steps, lr 1e-3, 20,480 eval games;
    # the paper's train-set size is unknown (a pre-generated set on disk): we use 1,000,000 games (~25 GB in host memory,
    # ~5 epochs). Tracked: the 16 central squares x layers 1-6 x positions 4, 8, ..., 56, per-type risks. The
    # reference runs one replay per position (14 runs x 6 sites); tracking does not change training, so one replay of
    # all 84 sites gives the same numbers. Needs a GPU.
    "paper": OthelloScale(
        "paper",
        {"n_layer": 6, "d_model": 256, "n_head": 4, "batch_size": 1024, "steps": 5000, "lr": 1e-3,
         "n_train": 1_000_000, "n_eval": 20_480, "eval_every": 500, "ckpt_every": 500, "log_every": 50},
        site_grid(range(1, 7), PAPER_POSITIONS), curve_every=50,
        note="the paper's setting"),
    # this shared 2-core CPU machine, under an hour including attribution, with 1 torch thread (3x faster than 2
    # threads under the load of other jobs). A 3-layer d-64 model at batch 64 trains at ~0.12 CPU-s/step; a tracked
    # step with 16 squares and per-type risks at one site costs ~0.5 CPU-s (directional derivatives along the 6
    # update directions; it was ~1.2 s with one backward per square and type). So: 1,600 steps over 51,200 games (two
    # epochs; lr 3e-3 to learn more in few steps) and one tracked site, layer 2 (of 3, so pre-caching is possible) at
    # position 30 (mid-game: both useful and useless stones on the central squares), with the 16 central squares.
    # The first version (400 steps) reached a legal-move accuracy of only 0.50. NOT the paper's setting.
    "small": OthelloScale(
        "small",
        {"n_layer": 3, "d_model": 64, "n_head": 4, "batch_size": 64, "steps": 1600, "lr": 3e-3,
         "n_train": 51_200, "n_eval": 4_096, "eval_every": 200, "ckpt_every": 200, "log_every": 20},
        site_grid((2,), (30,)), threads=1, curve_every=20,
        note="a small CPU setting, not the paper's"),
    # the CPU scale that reaches a world model (issue 32): chosen by the pilots of benchmarks/othello_pilots.py
    # (docs/results/othello-medium/pilots/): 4 layers, d 128, batch 256, lr 1e-3 with a 200-step warmup and a
    # cosine decay to 1e-4, one epoch of fresh games (7000 x 256 = 1.79 M, token-only: 0.98 GB), about 3.2
    # core-hours at the pilots' 0.56 M games a core-hour (the pilots' short curves extrapolate below the gates at 3
    # core-hours, so the run takes a little more). Tracked: layers 2-3 (the middle of 4) x positions 24, 36, the 16
    # central squares, the exact account on 16 evaluation games (the replay: 2.5 plain steps a step, counted by
    # benchmarks/othello_gpu_flops.py). NOT the paper's setting (smaller model, fewer games).
    "medium": OthelloScale(
        "medium",
        {"n_layer": 4, "d_model": 128, "n_head": 4, "batch_size": 256, "steps": 7000, "lr": 1e-3, "warmup": 200,
         "decay": "cosine", "final_lr_frac": 0.1, "n_train": 7000 * 256, "n_eval": 4096, "eval_every": 200,
         "ckpt_every": 100, "log_every": 50},
        site_grid((2, 3), (24, 36)), threads=1, curve_every=50, readout=16, pilots="pilots",
        note="a CPU scale chosen to reach a world model, not the paper's setting"),
    # issue 32's fallback: the medium model on a 6x6 board (Othello(board_size=6): 32 game tokens, 36 squares), the
    # same LR schedule as medium (warmup 200, cosine to 0.1). Steps from the 6x6 pilot
    # (docs/results/othello-medium/pilots/six-by-six.md): legal-move accuracy 0.929 after 1,200 steps at 0.72 CPU-s a
    # step; its power law reaches 0.97 at about 5,900 steps and 0.99 only at about 48,000, so 12,000 steps (3.07 M fresh
    # games, about 2.4 core-hours of training, predicted 0.979-0.983) are twice the need for the 0.97 floor. Tracked:
    # layer 3 (of 4) at position 18 (mid-game of 32 tokens), the 16 central squares (the inner 4x4, C3..F6, as on
    # 8x8), the exact account on 16 evaluation games, kept while training. One site, chosen 2026-12-06 before any
    # account of this scale was run, so that the run fits one 3-hour session of 2 cores: a tracked step costs 1.09
    # CPU-s at this site against 1.66 at layers 2-3 x positions 12, 18 (benchmarks/othello_gpu_flops.py --time 5),
    # 3.6 core-hours with the account beside the myopic run's 1.9, against 5.5. NOT the paper's setting (a 6x6 board).
    "medium-6x6": OthelloScale(
        "medium-6x6",
        {"board_size": 6, "n_layer": 4, "d_model": 128, "n_head": 4, "batch_size": 256, "steps": SIX_STEPS,
         "lr": 1e-3, "warmup": 200, "decay": "cosine", "final_lr_frac": 0.1, "n_train": SIX_STEPS * 256,
         "n_eval": 4096, "eval_every": 200, "ckpt_every": 100, "log_every": 50},
        site_grid((3,), (18,)), threads=1, curve_every=50, readout=16, pilots="../othello-medium/pilots",
        note="the medium model (4 layers, d 128, batch 256) on a 6×6 board: NOT the paper's setting"),
    # the paper's training on one GPU (scripts/othello_gpu.sh), with the replay's exact account on 256 evaluation
    # games at 6 of the paper's 84 sites (layers 3-4 x positions 20, 28, 36: the middle of the network and of the
    # game): a tracked step there costs 3.91 plain steps, unrefined, the 84 sites 32.8 (benchmarks/
    # othello_gpu_flops.py). Training set: one epoch of fresh games (5000 x 1024, token-only).
    "paper-gpu": OthelloScale(
        "paper-gpu",
        {"n_layer": 6, "d_model": 256, "n_head": 4, "batch_size": 1024, "steps": 5000, "lr": 1e-3,
         "n_train": 5_120_000, "n_eval": 20_480, "eval_every": 500, "ckpt_every": 500, "log_every": 50},
        site_grid((3, 4), (20, 28, 36)), curve_every=50, readout=256,
        note="the paper's training (fresh games); replays at 6 of its 84 sites, with the exact account"),
    # scripts/othello_gpu.sh --smoke: the paper-gpu code path at a size a CPU runs in a few minutes
    "paper-gpu-smoke": OthelloScale(
        "paper-gpu-smoke",
        {"n_layer": 6, "d_model": 32, "n_head": 4, "batch_size": 32, "steps": 40, "lr": 1e-3,
         "n_train": 1280, "n_eval": 512, "eval_every": 20, "ckpt_every": 20, "log_every": 10},
        site_grid((3, 4), (20, 28)), squares=("sq_C3", "sq_D4", "sq_E5", "sq_F6"), threads=1, curve_every=10,
        readout=64, fragility={"n_games": 40, "t0": 20, "n_boot": 200},
        note="smoke test of scripts/othello_gpu.sh, not the paper's setting"),
    # CI: the whole pipeline in well under a minute; checks the plumbing, not the science
    "smoke": OthelloScale(
        "smoke",
        {"n_layer": 2, "d_model": 32, "n_head": 2, "batch_size": 32, "steps": 12, "lr": 1e-3,
         "n_train": 384, "n_eval": 256, "eval_every": 6, "ckpt_every": 6, "log_every": 2},
        site_grid((1, 2), (12,)), squares=("sq_C3", "sq_D4", "sq_E5", "sq_F6"), threads=1, curve_every=2,
        fragility={"n_games": 40, "t0": 20, "n_boot": 200}, note="CI smoke test, not the paper's setting"),
}


class _Timer:
    """Accumulates the wall and CPU time of the stages that did work into ``out/timings.json`` (atomically)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = read_json(path) if path.exists() else {}

    @contextmanager
    def stage(self, name: str, done: bool, steps: int | None = None):
        """Time the ``with`` block as stage ``name`` (of ``steps`` training steps) and add it to the record, unless
        ``done`` (skipped)."""
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        if not done:
            self.add(name, time.perf_counter() - t0, time.process_time() - c0, steps)

    def add(self, name: str, wall_s: float, cpu_s: float, steps: int | None = None) -> None:
        """Add ``wall_s`` and ``cpu_s`` seconds (and, for a training, the ``steps`` they trained: ``"steps"``) to
        stage ``name`` and write the record. A training resumed from a call cut off before it recorded its time
        covers only its own steps, so its seconds per step are read over those."""
        cpu = self.data.setdefault("cpu_s", {})
        self.data[name] = round(self.data.get(name, 0.0) + wall_s, 3)
        cpu[name] = round(cpu.get(name, 0.0) + cpu_s, 3)
        if steps is not None:
            timed = self.data.setdefault("steps", {})
            timed[name] = timed.get(name, 0) + steps
        write_json(self.path, self.data)


def _train_job(cfg_dict: dict, run_dir: str, threads: int | None, account: AccountSpec | None = None, *,
               stages: bool = False) -> dict:
    """The job of one training run (for ``run_jobs``): train (or resume) it on ``threads`` torch threads, with
    ``account`` if given; returns its ``run_dir`` and the wall and CPU seconds (of the worker process) it took."""
    t0, c0 = time.perf_counter(), time.process_time()
    with on_threads(threads):
        train(TrainConfig.from_dict(cfg_dict), run_dir, progress=stages, account=account)
    return {"run_dir": run_dir, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def run_othello(scale: str | OthelloScale, out: str | Path, *, device: str = "auto", progress: bool = True,
                reading: str = "exact", replays: bool = True, workers: int | None = None) -> Path:
    """Run (or resume) every stage of ``scale`` into ``out`` and write the report. Returns ``out``.

    ``out/run`` is the run directory (:class:`OthelloOut`: the layout); ``out/data.json``, ``out/report.{md,html}``, ``out/summary.json`` and
    ``out/figures/`` the results. A second call with finished stages only regathers and rewrites the report.
    ``reading``: how the replay reads the influence (``ntpflow.replay.attribution.attribute``; default: the exact
    account).
    ``scale.readout`` sets the exact account's readout size (None: attribute's default).
    ``replays=False`` skips only the tracked replay (stage 5; the influence claims then read not testable); a later
    call with replays adds it. The myopic run and the fragility test (stage 4) run in either case. A first report is
    written as soon as the vanilla run is trained and probed (claim (i) and the gates), before the myopic run.
    ``workers`` ≥ 2 trains the vanilla and the myopic run side by side in worker processes (default: 2 on a CPU
    with 2 cores or more, 1 on a GPU, where the runs take turns); the first report then waits for both. On a machine
    with several GPUs (device auto or cuda) the vanilla run with the account trains as one worker per GPU
    (``train --workers``, NCCL), each on its share of the batch and the readout.
    """
    scale = resolve_scale(scale, SCALES, OthelloScale)
    layout = OthelloOut(ensure_writable_dir(out))
    cfg, myopic_cfg = scale.config(device), scale.config(device, "myopic")
    timer = _Timer(layout.timings)
    trainings = (("vanilla", cfg, layout.run_dir, "train"), ("myopic", myopic_cfg, layout.myopic_dir, "train_myopic"))
    readout = (scale.readout or min(256, cfg.n_eval)) if reading == "exact" else None
    kept = account_for(layout.run_dir, list(scale.sites) if replays and reading == "exact" else [], readout)
    accounts = {"vanilla": None if kept is None else replace(kept, chunks=scale.account_chunks,
                                                                 types=tuple(scale.squares)), "myopic": None}
    pending = [(name, c, run_dir, stage) for name, c, run_dir, stage in trainings if not Run(run_dir, c).done]
    to_train = {stage: c.steps - max(Run(run_dir, c).checkpoints(), default=0)  # a resumed run: the steps left
                for _, c, run_dir, stage in pending}
    gpus = gpu_count(device)
    if workers is None:
        workers = min(2, os.cpu_count() or 1) if resolve_device(device).type == "cpu" else 1
    if workers > 1 and len(pending) > 1:
        dirs = [str(run_dir) for _, _, run_dir, _ in pending]
        if progress:
            log.info("othello %s: training %s side by side", scale.name, ", ".join(dirs))
        done = run_jobs(_train_job, [(c.to_dict(), d, scale.threads, accounts[name])
                                     for (name, c, _, _), d in zip(pending, dirs)],
                        workers, f"othello {scale.name} training", progress)
        for (*_, stage), r in zip(pending, done):
            timer.add(stage, r["wall_s"], r["cpu_s"], to_train[stage])
    with on_threads(scale.threads):
        runs = {}
        for name, c, run_dir, stage in trainings:
            trained = Run(run_dir, c).done
            with timer.stage(stage, trained, to_train.get(stage)):
                if progress and not trained:
                    log.info("othello %s: training %s (%s)", scale.name, run_dir, name)
                account = accounts[name]
                if account is not None and gpus > 1 and not trained:  # the account's workers, one per GPU
                    runs[name] = train_with_workers(c, run_dir, account, gpus)
                else:
                    runs[name] = train(c, run_dir, progress=progress, account=account)
            if name == "vanilla":  # claim (i) and the gates need only the vanilla run: report them before the myopic
                _probe_vanilla(runs[name], timer, device)
                write_json(layout.data, gather(scale, layout.dir))
                write_report(layout.dir)
        run = runs["vanilla"]
        with timer.stage("probes_myopic", ProbeSet.saved(runs["myopic"].probes_dir("final"))):
            load_or_probe(runs["myopic"], "final", device)
        with timer.stage("fragility", _fragility_done(layout)):
            if not _fragility_done(layout):
                run_fragility({k: r.dir for k, r in runs.items()}, layout.fragility_dir, device=device,
                              **scale.fragility)
        with timer.stage("attribution", run.attribution().done or not replays):
            if replays:  # read from the run's account where it was trained with one, else replayed
                attribute(run.dir, AttributionSpec(scale.sites, scale.squares, reading=reading, readout=readout),
                          device=device, progress=progress)
        write_json(layout.data, gather(scale, layout.dir))
        write_report(layout.dir)
    return layout.dir


def _probe_vanilla(run: Run, timer: _Timer, device: str) -> None:
    """Stages 2-3 on the vanilla run: ridge probes and 3-way classifiers of the final and the step-0 weights."""
    for which in ("final", "init"):
        with timer.stage(f"probes_{which}", ProbeSet.saved(run.probes_dir(which))):
            load_or_probe(run, which, device)
        with timer.stage(f"classifier_{which}", run.classifier_path(which).with_suffix(".json").exists()):
            load_or_classify(run, which, device)


def _fragility_done(layout: OthelloOut) -> bool:
    """Whether the fragility test has written its result with the intervals (a result from before them is redone)."""
    return layout.fragility.exists() and "comparisons" in read_json(layout.fragility)


# ---------------------------------------------------------------------------------------------------- gather


def _num(x, digits: int = 6):
    """``x`` to ``digits`` significant digits (None if not finite), for a compact, stable data.json."""
    x = float(x)
    return float(f"{x:.{digits}g}") if math.isfinite(x) else None


def gather(scale: OthelloScale, out: Path) -> dict:
    """Collect the finished stages of ``out`` (:class:`OthelloOut`) into the data.json dict (schema:
    ``othello_report``)."""
    layout = OthelloOut(Path(out))
    run = Run.open(layout.run_dir)
    cfg = run.cfg
    done = run.final_record()
    metrics = run.metrics()
    eval_curve = [{k: m[k] for k in ("step", "eval_loss", "legal_acc", "first_acc") if k in m}
                  for m in metrics if m["kind"] == "eval"]
    train_curve = [{"step": m["step"], "loss": m["loss"]} for m in metrics if m["kind"] == "train"]
    probes, feature_names = _probe_records(run)
    att = run.attribution()
    by_mismatch, curves = (_influence_records(att, cfg.steps - 1, scale.curve_every) if att.influence.exists()
                           else ({"paper": [], "centred": []}, []))  # no replay (yet)
    by_sgd = (_influence_records(att, cfg.steps - 1, scale.curve_every, "sgd")[0] if att.influence.exists()
              else {"paper": []})  # the SGD direction, for the claims' meaning checks (empty: not kept)
    sanity, mismatch = _held_out_records(att)
    timings = read_json(layout.timings) if layout.timings.exists() else {}
    spec = read_json(att.spec) if att.spec.exists() else {}  # how the influence was read (none yet: {})
    return {
        "scale": scale.name, "scale_note": scale.note, "seed": cfg.seed, "train": scale.train,
        "config": cfg.to_dict(), "n_params": _n_params(run),
        "sites": [[s.layer, s.pos] for s in scale.sites], "squares": list(scale.squares),
        "feature_names": feature_names,
        "run": {k: v for k, v in done.items() if k != "step"}, "eval_curve": eval_curve, "train_curve": train_curve,
        "probes": probes, "influence": by_mismatch["paper"], "curves": curves, "sanity": sanity,
        "influence_centred": by_mismatch["centred"], "mismatch": mismatch, "influence_sgd": by_sgd["paper"],
        "optimizer": cfg.own_rows,
        "timings": timings, "influence_read_at": influence_read_at([att.dir] if att.summary.exists() else []),
        "fragility": _fragility_record(layout), "pilots": scale.pilots,
        "readout": spec.get("readout"),
        "account_kept": bool(spec.get("account")),  # the influence read from the account kept while training
    }


def _fragility_record(layout: OthelloOut) -> dict | None:
    """The fragility test's result (``fragility.json`` without the runs' folders) and, for the world-model gates of
    the myopic run, its legal-move accuracy and its useful squares' final ridge r per layer (None before the
    test)."""
    if not layout.fragility.exists():
        return None
    result = {k: v for k, v in read_json(layout.fragility).items() if k != "runs"}
    myopic = Run.open(layout.myopic_dir)
    r = ProbeSet.load(myopic.probes_dir("final")).r_by_type.get(2)
    by_layer = []
    if r is not None:  # per square the mean over the probed positions, then the mean over squares (as the report)
        per_square = r.double().nanmean(1)  # [L+1, 64]
        by_layer = [{"layer": k, "mean": _num(per_square[k][~per_square[k].isnan()].mean())}
                    for k in range(per_square.shape[0]) if not per_square[k].isnan().all()]
    return {**result, "myopic": {"legal_acc": _num(myopic.final_record().get("legal_acc", math.nan)),
                                 "useful_r_by_layer": by_layer, "config": myopic.cfg.to_dict()}}


def _probe_records(run: Run) -> tuple[list[dict], list[str]]:
    """One record per (weights, metric, type, layer, pos) with the 64 per-square values of the ridge probes (r) and
    the classifier (acc); and the probed feature names."""
    probes = []
    for weights in ("final", "init"):
        ps = ProbeSet.load(run.probes_dir(weights))
        cl = ClassifierProbes.load(run.classifier_path(weights))
        sources = {("r", "all"): ps.r, ("acc", "all"): cl.acc}
        for t, name in TYPE_NAMES.items():
            if t in ps.r_by_type:
                sources[("r", name)] = ps.r_by_type[t]
            if t in cl.acc_by_type:
                sources[("acc", name)] = cl.acc_by_type[t]
        for (metric, tname), arr in sources.items():
            arr = arr.double().cpu()
            for layer in range(arr.shape[0]):
                for pos in ps.positions:
                    probes.append({"weights": weights, "metric": metric, "type": tname, "layer": layer, "pos": pos,
                                   "values": [_num(v) for v in arr[layer, pos].tolist()]})
    return probes, list(ps.feature_names)


def _influence_records(att: AttributionDir, last: int, curve_every: int, optimizer: str = "adam"
                       ) -> tuple[dict, list[dict]]:
    """``({"paper": rows, "centred": rows}, curves)``: the integrated (= summed) influence of reading ``optimizer``
    per (layer, pos,
    square, type, component) for the paper's R and the centred R_c (risk rows have mismatch "none"), and the mean
    over units (layer × pos × square with that type) of the cumulative influence on R every ``curve_every`` steps
    and at step ``last``."""
    full_table = pq.read_table(att.influence,
                               columns=["step", "layer", "pos", "feature", "feature_type", "mismatch", "component",
                                        "value"], filters=[("optimizer", "==", optimizer)])
    totals = full_table.group_by(["layer", "pos", "feature", "feature_type", "mismatch", "component"]).aggregate(
        [("value", "sum"), ("value", "count")]).to_pylist()
    by_mismatch = {"paper": [], "centred": []}
    for r in totals:
        if r["mismatch"] in by_mismatch:
            by_mismatch[r["mismatch"]].append(
                {"layer": r["layer"], "pos": r["pos"], "square": r["feature"],
                 "type": TYPE_NAMES.get(r["feature_type"], str(r["feature_type"])), "component": r["component"],
                 "total": _num(r["value_sum"], 12), "n_steps": r["value_count"]})
    # pyarrow.compute functions are generated at import; not in the stubs
    table = full_table.filter(pc.equal(full_table["mismatch"], "paper"))  # pyright: ignore[reportAttributeAccessIssue]
    units = {}
    for r in by_mismatch["paper"]:
        units.setdefault((r["type"], r["component"]), set()).add((r["layer"], r["pos"], r["square"]))
    per_step = table.group_by(["step", "feature_type", "component"]).aggregate([("value", "sum")])
    per_step = per_step.sort_by([("feature_type", "ascending"), ("component", "ascending"), ("step", "ascending")])
    curves, acc = [], {}
    for r in per_step.to_pylist():
        tname = TYPE_NAMES.get(r["feature_type"], str(r["feature_type"]))
        key = (tname, r["component"])
        acc[key] = acc.get(key, 0.0) + r["value_sum"]
        if (r["step"] + 1) % curve_every == 0 or r["step"] == last:
            curves.append({"step": r["step"] + 1, "type": tname, "component": r["component"],
                           "mean_cumulative": _num(acc[key] / len(units[key]), 12)})
    return by_mismatch, curves


def _held_out_records(att: AttributionDir) -> tuple[list[dict], list[dict]]:
    """``(sanity, mismatch)`` from the attribution's summary (empty without one): per tracked site × square, the
    held-out R removed beside the full Adam influence (the paper's R), and per mismatch R(θ_0), R removed and the
    offset share."""
    sanity, mismatch = [], []
    if att.summary.exists():
        for p in read_json(att.summary)["probes"]:  # one entry per tracked site x square x mismatch
            site = {"layer": p["layer"], "pos": p["pos"], "square": p["feature"]}
            mismatch.append({**site, "mismatch": p.get("mismatch", "paper"),
                             **{k: _num(p.get(k, math.nan), 12)
                                for k in ("R0_eval", "R0_minus_RT_eval", "offset_share_R0")},
                             **{k: _num(p[k], 12) for k in ("change", "residual") if k in p}})  # exact account
            if p.get("mismatch", "paper") == "paper":  # the sanity check and figures use the paper's R
                sanity.append({**site, "R0_minus_RT_eval": _num(p["R0_minus_RT_eval"], 12),
                               "adam_full": _num(p.get("adam_full", math.nan), 12)})
    return sanity, mismatch


def _n_params(run) -> int:
    return sum(p.numel() for p in run.load_model("init").parameters())
