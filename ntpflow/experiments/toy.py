"""The toy-task reproduction (docs/paper.md#majority): majority and conditioned majority in four regimes.

``run_toy(scale, out)`` trains every (task, regime, seed), the runs of the tracked regimes with the exact account at
the tracked sites (``train --account``; a run begun without it is replayed instead), fits probes on the final and the
untrained model, attributes the tracked runs from their accounts, and gathers everything into ``out/data.json``. At
the scales marked ``grouped`` the seeds of a (task, regime) train as one run group (``ntpflow.runs.group``): one
batched model, written as ordinary run directories, its tracked members keeping their accounts while it trains
(members begun without one are replayed together in one replay of the group,
``ntpflow.replay.attribution.attribute_group``).
Every stage is resumable and skipped when finished, so an interrupted call continues where it stopped.
"""

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from ntpflow.experiments.formats import curve_steps, reading_rows
from ntpflow.experiments.parallel import gpu_count, job_devices, on_threads, one_run, run_jobs, run_threads
from ntpflow.experiments.scales import resolve_scale, site_grid
from ntpflow.files import ensure_writable_dir, read_json, write_json
from ntpflow.model.sites import Site, feature_name
from ntpflow.probes import ProbeSet
from ntpflow.replay.attribution import attribute_group, influence_read_at
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import account_for
from ntpflow.runs.config import REGIMES, TrainConfig
from ntpflow.runs.group import train_group
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run
from ntpflow.stats import finite_or_none as _finite
from ntpflow.tasks import CondMajority, Majority, make_task

log = logging.getLogger(__name__)

TASKS = ("majority", "cond_majority")
Regime = Literal["vanilla", "myopic", "untied", "myopic-untied"]  # TrainConfig.regime, the names in REGIMES
# tracked feature per task (the NTP-useless feature of the paper)
TRACKED = {"majority": ("is_majority_0", "is_majority_1", "is_majority_2"), "cond_majority": ("prev_is_0",)}


@dataclass(frozen=True)
class ToyScale:
    """Settings of one scale. ``train`` holds TrainConfig overrides shared by all runs and ``task_train`` those of
    one task (e.g. its steps); ``grouped`` trains the seeds of each (task, regime) as one run group
    (``ntpflow.runs.group``); ``tracked`` names the regimes whose runs are replayed with influence tracking, and
    ``tracked_seeds`` (None: all) which of their seeds; ``tasks`` the tasks the scale is for (default both)."""

    name: str
    seeds: tuple[int, ...]
    sites: tuple[Site, ...]
    train: dict = field(default_factory=dict)
    curve_every: int = 10
    grouped: bool = False
    tracked: tuple[str, ...] = REGIMES
    task_train: dict = field(default_factory=dict)
    tracked_seeds: tuple[int, ...] | None = None
    tasks: tuple[str, ...] = TASKS

    def is_tracked(self, cfg: TrainConfig) -> bool:
        """Whether the run of ``cfg`` is replayed with influence tracking."""
        return cfg.regime in self.tracked and (self.tracked_seeds is None or cfg.seed in self.tracked_seeds)


READOUT = 256  # the exact account's readout set (at most the run's n_eval): the committed results'
MOMENTUM_LR = 0.03  # the pilot's choice by its rule, fixed before it ran (docs/results/toy-momentum-pilot/README.md)
MAX_CURVE_POINTS = 200  # influence curves keep at most about this many steps per run (the last step always)


SCALES = {
    # the paper: 2 layers, d 128, 4 heads, batch 256, 3000 steps, lr 1e-3, 102,400 sequences, 10 seeds,
    # tracked sites layers 1-2 x positions 2-19 in the 20 vanilla runs; the 10 seeds of a (task, regime) train as
    # one run group (scripts/paper_gpu.sh)
    "paper": ToyScale("paper", tuple(range(10)), site_grid((1, 2), range(2, 20)),
                      {"steps": 3000, "n_train": 102_400, "n_eval": 10_240, "eval_every": 500, "ckpt_every": 500},
                      curve_every=50, grouped=True, tracked=("vanilla",)),
    # this 2-core machine in under an hour for both tasks: a narrower model (d_model 64), 3 seeds, 300 steps
    # (the toy tasks are learned within a few hundred steps), 25,600 sequences, and 3 tracked sites at layer 1:
    # input positions 4 and 8, where the features are NTP-useless, and output position 14, where they are useful
    "small": ToyScale("small", (0, 1, 2), site_grid((1,), (4, 8, 14)),
                      {"steps": 300, "d_model": 64, "n_train": 25_600, "n_eval": 4_096, "eval_every": 100,
                       "ckpt_every": 100},
                      curve_every=5),
    # the paper's model (2 layers, d 128, 4 heads, batch 256, lr 1e-3, 102,400 sequences) on this 2-core machine:
    # 5 seeds, all four regimes. Steps per task: majority the paper's 3000 (claim (a) is about what the paper's
    # training does; vanilla passes the toy gates by step 200); conditioned majority fails the gates on 4 of 5 seeds
    # at the paper's 3000 and passes at every evaluation from step 4200 on every seed (learning curves to 5000 steps,
    # docs/experiments/toy.md), so 5000. Three vanilla seeds per task are replayed at layer-1 sites: input
    # positions 4, 6, 8 (NTP-useless) and output position 14 (useful). Layer-2 sites are the last residual, where
    # pre-caching is zero by construction.
    "medium": ToyScale("medium", (0, 1, 2, 3, 4), site_grid((1,), (4, 6, 8, 14)),
                       {"n_train": 102_400, "n_eval": 10_240, "eval_every": 200, "ckpt_every": 200},
                       curve_every=10, tracked=("vanilla",), tracked_seeds=(0, 1, 2),
                       task_train={"majority": {"steps": 3000}, "cond_majority": {"steps": 5000}}),
    # the momentum-SGD control of claim (c) (docs/balance.md#conditioning): medium's model, data, steps and tracked
    # sites, trained with SGD with momentum 0.9 at the learning rate of the pilot (docs/results/toy-momentum-pilot),
    # whose split of a step into the components is the step's own; vanilla only, every seed tracked
    "medium-momentum": ToyScale("medium-momentum", (0, 1, 2, 3, 4), site_grid((1,), (4, 6, 8, 14)),
                                {"n_train": 102_400, "n_eval": 10_240, "eval_every": 200, "ckpt_every": 200,
                                 "optimizer": "sgd", "momentum": 0.9, "lr": MOMENTUM_LR},
                                curve_every=10, tracked=("vanilla",),
                                task_train={"majority": {"steps": 3000}, "cond_majority": {"steps": 5000}}),
    # the momentum-SGD control for conditioned majority: medium-momentum's constant rate does not learn it in 5000
    # steps, and the third pilot (docs/results/toy-momentum-pilot, fixed 2026-12-07 before it ran) chose peak lr 0.1
    # with a 200-step warmup and a cosine decay to 0.1 x the peak over 20,000 steps; medium's model, data and tracked
    # sites, every seed tracked (run it with --regimes vanilla, as the claim reads)
    "medium-momentum-cond": ToyScale("medium-momentum-cond", (0, 1, 2, 3, 4), site_grid((1,), (4, 6, 8, 14)),
                                     {"n_train": 102_400, "n_eval": 10_240, "eval_every": 500, "ckpt_every": 200,
                                      "optimizer": "sgd", "momentum": 0.9, "lr": 0.1, "warmup": 200,
                                      "decay": "cosine", "final_lr_frac": 0.1, "steps": 20_000},
                                     curve_every=100, tracked=("vanilla",), tasks=("cond_majority",)),
    # CI: a narrow model, 40 steps, two sites; checks the pipeline, not the science
    "smoke": ToyScale("smoke", (0,), site_grid((1,), (5, 12)),
                      {"steps": 40, "d_model": 32, "n_head": 2, "batch_size": 64, "n_train": 2_560, "n_eval": 512,
                       "eval_every": 20, "ckpt_every": 20},
                      curve_every=2),
    # the paper scale's code path (run groups, the tracked vanilla members keeping the account) at the smoke size:
    # scripts/paper_gpu.sh --smoke
    "paper-smoke": ToyScale("paper-smoke", (0, 1), site_grid((1,), (5, 12)),
                            {"steps": 40, "d_model": 32, "n_head": 2, "batch_size": 64, "n_train": 2_560,
                             "n_eval": 512, "eval_every": 20, "ckpt_every": 20},
                            curve_every=2, grouped=True, tracked=("vanilla",)),
}


def run_configs(scale: ToyScale, tasks: tuple[str, ...] = TASKS,
                regimes: tuple[Regime, ...] = REGIMES) -> list[TrainConfig]:
    """The TrainConfigs of every task (of ``tasks``) × regime (of ``regimes``) × seed of ``scale``."""
    return [TrainConfig(task=t, regime=r, seed=s, **{**scale.train, **scale.task_train.get(t, {})})
            for t in tasks for r in regimes for s in scale.seeds]


def run_dir_name(cfg: TrainConfig) -> str:
    """Run folder name of a config: ``<task>-<regime>-s<seed>``."""
    return f"{cfg.task}-{cfg.regime}-s{cfg.seed}"


def _one_group(cfg_dicts: list[dict], run_dirs: list[str], sites: list[list[tuple[int, int]]], device: str,
               threads: int, *, stages: bool = False) -> dict:
    """Train the runs of one (task, regime) as one run group, member r with the exact account at ``sites[r]`` (none:
    without; a member begun without it stays so), then probe each (final and step 0), on ``threads`` torch threads
    (the caller's count is restored); stage lines when ``stages`` (see ``run_jobs``)."""
    cfgs = [TrainConfig.from_dict(d) for d in cfg_dicts]
    accounts = [account_for(d, [Site(*s) for s in ss], min(READOUT, c.n_eval))
                for c, d, ss in zip(cfgs, run_dirs, sites)]
    with on_threads(threads):
        for run in train_group(cfgs, run_dirs, progress=stages, accounts=accounts):
            load_or_probe(run, "final", device)
            load_or_probe(run, "init", device)
    return {"run_dirs": run_dirs}


def _group_attribution(run_dirs: list[str], sites: list[tuple[int, int]], features: list[str], device: str,
                       threads: int, reading: str = "exact", *, stages: bool = False) -> dict:
    """Attribute the tracked members ``run_dirs`` of one run group: read from their accounts, the members trained
    without one in one replay of the group (finished ones skipped), on ``threads`` torch threads (the caller's count
    is restored); stage lines when ``stages``."""
    with on_threads(threads):
        n_eval = min(Run.open(d).cfg.n_eval for d in run_dirs)
        attribute_group(run_dirs, AttributionSpec([Site(*s) for s in sites], features, reading=reading,
                                        readout=min(READOUT, n_eval) if reading == "exact" else None),
                        device=device, progress=stages)
    return {"run_dirs": run_dirs}


def run_toy(scale: str | ToyScale, out: str | Path, *, workers: int | None = None, device: str = "auto",
            progress: bool = True, tasks: tuple[str, ...] | None = None, regimes: tuple[str, ...] = REGIMES,
            seeds: tuple[int, ...] | None = None, replays: bool = True, reading: str = "exact") -> Path:
    """Run (or resume) every run of ``scale`` (for ``tasks``, ``regimes`` and ``seeds``, a subset of the scale's;
    None: all its tasks) into ``out/runs`` and gather ``out/data.json``.
    ``replays=False`` trains and probes only: the influence tracking (the costly part, the account or a replay) is
    skipped, and the influence claims come out not testable; a later call with ``replays=True`` adds it by replaying
    the tracked runs. ``reading`` is how the influence is read (``ntpflow.replay.attribution.attribute``: the exact
    account by default, kept while training). Returns ``out``."""
    scale = resolve_scale(scale, SCALES, ToyScale)
    if seeds is not None:
        if not seeds or set(seeds) - set(scale.seeds):
            raise ValueError(f"seeds {sorted(set(seeds) - set(scale.seeds)) or '(none)'} are not seeds of scale "
                             f"{scale.name}; choose from {list(scale.seeds)}")
        scale = replace(scale, seeds=tuple(sorted(set(seeds))), tracked_seeds=None if scale.tracked_seeds is None
                        else tuple(s for s in scale.tracked_seeds if s in seeds))
    tasks = scale.tasks if tasks is None else tasks
    if set(tasks) <= set(TASKS) and set(tasks) - set(scale.tasks):
        raise ValueError(f"scale {scale.name} is for the task(s) {list(scale.tasks)}, not "
                         f"{sorted(set(tasks) - set(scale.tasks))}")
    for kind, given, known in (("task", tasks, TASKS), ("regime", regimes, REGIMES)):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            raise ValueError(f"unknown toy {kind}(s) {unknown}; choose from {list(known)}")
    out = ensure_writable_dir(out)
    (out / "runs").mkdir(exist_ok=True)
    configs = run_configs(scale, tuple(t for t in TASKS if t in tasks), tuple(r for r in REGIMES if r in regimes))
    gpus = gpu_count(device)  # several: the jobs take the GPUs in turn
    workers = workers or min(len(configs), os.cpu_count() or 1)
    threads = run_threads(device, workers)
    sites = [(s.layer, s.pos) for s in scale.sites]
    run_dir = {c: str(out / "runs" / run_dir_name(c)) for c in configs}

    def tracked(c: TrainConfig) -> bool:
        return replays and scale.is_tracked(c)

    if scale.grouped:  # every seed of a (task, regime) at once (the tracked ones with the account), then attribute
        groups = {(c.task, c.regime): [g for g in configs if (g.task, g.regime) == (c.task, c.regime)]
                  for c in configs}
        on = job_devices(device, len(groups), gpus)
        run_jobs(_one_group, [([{**c.to_dict(), "device": dev} for c in g], [run_dir[c] for c in g],
                               [sites if tracked(c) and reading == "exact" else [] for c in g], dev, threads)
                              for g, dev in zip(groups.values(), on)], workers, f"toy {scale.name} groups", progress)
        tracked_of = [[run_dir[c] for c in g if tracked(c)] for g in groups.values()]  # one attribution per group
        run_jobs(_group_attribution, [(dirs, sites, list(TRACKED[g[0].task]), dev, threads, reading)
                                      for g, dirs, dev in zip(groups.values(), tracked_of, on) if dirs], workers,
                 f"toy {scale.name} attributions", progress)
    else:
        jobs = [({**c.to_dict(), "device": dev}, run_dir[c], sites if tracked(c) else [], list(TRACKED[c.task]), dev,
                 threads, reading) for c, dev in zip(configs, job_devices(device, len(configs), gpus))]
        run_jobs(one_run, jobs, workers, f"toy {scale.name}", progress)
    data = gather(scale, out, configs, replays)
    write_json(out / "data.json", data)
    return out


def gather(scale: ToyScale, out: Path, configs: list[TrainConfig], replays: bool = True) -> dict:
    """Collect tidy records from the finished runs (see ``ntpflow.experiments.toy_report`` for the schema); without
    ``replays`` no run counts as tracked."""
    runs, probes, influence, curves, mismatch, eval_curves, attributed = [], [], [], [], [], [], []
    for cfg in configs:
        run = Run(out / "runs" / run_dir_name(cfg), cfg)
        key = {"task": cfg.task, "regime": cfg.regime, "seed": cfg.seed}
        task = make_task(cfg.task)
        if not isinstance(task, (Majority, CondMajority)):  # the TASKS, whose optimal loss is exact
            raise TypeError(f"toy runs are of the tasks {TASKS}, not {cfg.task!r}")
        done = {k: v for k, v in run.final_record().items() if k != "step"}
        runs.append({**key, **done, "steps": cfg.steps, "optimal_loss": task.optimal_loss(),
                     "loss_gap": done["eval_loss"] - task.optimal_loss()})
        eval_curves += [{**key, "step": m["step"], "loss_gap": m["eval_loss"] - task.optimal_loss(),
                         "first_acc": m.get("first_acc")} for m in run.metrics() if m["kind"] == "eval"]
        for weights in ("final", "init"):
            ps = ProbeSet.load(run.probes_dir(weights))
            for f, name in enumerate(ps.feature_names):
                for layer in range(ps.r.shape[0]):
                    for pos in ps.positions:
                        probes.append({**key, "weights": weights, "layer": layer, "pos": pos, "feature": name,
                                       "r": _finite(ps.r[layer, pos, f].item()),
                                       "useful": bool(task.useful[pos, f])})
        if not (replays and scale.is_tracked(cfg)):
            continue
        att = run.attribution()
        attributed.append(att.dir)
        own = cfg.own_rows  # the run's own split; the SGD direction ("sgd") beside it where the replay kept it
        rows = reading_rows(att.influence, own)
        last = max(r["step"] for r in rows)
        stride = max(scale.curve_every, last // MAX_CURVE_POINTS)  # a long run keeps its curves (and data.json) small
        on_curve = curve_steps((r["step"] for r in rows), stride)
        for r in rows:
            site = {"layer": r["layer"], "pos": r["pos"], "feature": feature_name(r["feature"]),
                    "mismatch": r["mismatch"]}
            if r["step"] == last:
                influence.append({**key, **site, "component": r["component"], "total": r["cumulative"],
                                  "optimizer": r["optimizer"],
                                  "useful": bool(task.useful[r["pos"], task.feature_names.index(feature_name(r["feature"]))])})
            if r["optimizer"] == own and r["step"] in on_curve:
                curves.append({**key, **site, "step": r["step"] + 1, "component": r["component"],
                               "cumulative": r["cumulative"]})
        for p in read_json(att.summary)["probes"]:  # held-out R(θ_0), R removed, offset
            name = feature_name(p["feature"])
            mismatch.append({**key, **{k: p[k] for k in ("layer", "pos", "mismatch", "R0_eval",
                                                         "R0_minus_RT_eval", "offset_share_R0")}, "feature": name,
                             **{k: p[k] for k in ("change", "residual") if k in p},  # the exact account's
                             **{k: v for k, v in p.items() if k.startswith("kappa") or k == "signs_agree"},
                             "useful": bool(task.useful[p["pos"], task.feature_names.index(name)])})
    tasks = sorted({c.task for c in configs}, key=TASKS.index)
    return {"scale": scale.name, "seeds": list(scale.seeds), "sites": [[s.layer, s.pos] for s in scale.sites],
            "influence_read_at": influence_read_at(attributed), "train": scale.train,
            "optimizer": configs[0].own_rows,
            "task_train": {t: scale.task_train.get(t, {}) for t in tasks},
            "tracked": {t: list(TRACKED[t]) for t in tasks},
            "tracked_seeds": list(scale.tracked_seeds if scale.tracked_seeds is not None else scale.seeds)
            if replays else [], "replays": replays,
            "runs": runs, "probes": probes, "influence": influence, "curves": curves, "mismatch": mismatch,
            "eval_curves": eval_curves}
