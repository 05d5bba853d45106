"""Command line: ``ntpflow {train,probe,attribute,discover,balance,breakdown,reproduce,sweep,qscan,demo} ...``.

Parses input, builds configs, calls library functions."""

import argparse
import hashlib
import logging
import sys
import textwrap
from pathlib import Path

from ntpflow import __version__
from ntpflow.experiments.report_all import run_all, run_experiment
from ntpflow.experiments.run_report import write_run_report
from ntpflow.files import read_json, resolve_device, stamp
from ntpflow.llm.qscan_cli import main as qscan_main
from ntpflow.model.sites import Site, parse_sites
from ntpflow.probes import probe_table, write_r_table
from ntpflow.replay.answer import answer_lines
from ntpflow.replay.attribution import attribute, attribute_group
from ntpflow.replay.balance import audit_balance
from ntpflow.replay.breakdown import breakdown, parse_steps
from ntpflow.replay.directions import parse_direction, sae_directions
from ntpflow.replay.discover import discover
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import DEFAULT_CHUNKS, AccountSpec, account_sites
from ntpflow.runs.config import REGIMES, config_from
from ntpflow.runs.group import group_dirs
from ntpflow.runs.probe import check_feature, load_or_probe, probe_run
from ntpflow.runs.run import AttributionDir, Run
from ntpflow.runs.sweep import SweepSpec, failures, run_sweep
from ntpflow.runs.training import train
from ntpflow.runs.workers import is_follower, launch, leave_workers, worker_env

DESCRIPTION = (
    "ntpflow trains small GPT-2 models on next-token prediction in four regimes, splits the training gradient "
    "exactly into direct, pre-caching and circuit-sharing parts, and measures how much each part built a probed "
    "feature. It reproduces the experiments of Rofin, Naghiyev & Hahn (ICLR 2026).\n\n"
    "`ntpflow COMMAND --help` shows a command's options and examples; docs/ the rest.")

TRAIN_EXAMPLES = """
examples:
  ntpflow train --task majority --regime myopic --seed 0 --out runs/maj-myopic-s0
  ntpflow train --task cond_majority --regime untied --set steps=500 lr=3e-4
  ntpflow train --task mytasks:Parity --regime vanilla   # a task of your own (docs/tasks.md)

Python equivalent:
  ntpflow.train(ntpflow.TrainConfig(task="majority", regime="myopic", seed=0), "runs/maj-myopic-s0")
"""

EXAMPLES = """
examples:
  ntpflow train --task majority --regime myopic --seed 0 --out runs/maj-myopic-s0
  ntpflow train --task cond_majority --regime untied --set steps=500 lr=3e-4
  ntpflow probe runs/maj-myopic-s0 --feature 'is_majority_0'
  ntpflow attribute runs/maj-myopic-s0 --sites 1-2:2-19 --features 'is_majority_0'
  ntpflow attribute runs/maj-vanilla-s0 --group --sites 1-2:2-19   # every member of its run group, one replay
  ntpflow balance runs/maj-vanilla-s0 --sites 1:4,1:6 --features 'is_majority_0'   # where the balance goes
  ntpflow reproduce toy --scale small   # both toy tasks, four regimes, seeds, report
  ntpflow reproduce othello --scale small
  ntpflow reproduce stories --scale small   # the TinyStories sample shipped in the package (or --corpus PATH|hf)
  ntpflow reproduce llm --scale small
  ntpflow reproduce all --scale small   # every experiment + one report: ~2.5-3 h on 2 cores
  ntpflow qscan --model tiny --train-sae --latents 8 --docs 8 --steps 50 --out runs/qscan-tiny
  ntpflow demo --out runs/demo          # majority in the four regimes, ~5 min (scripts/demo.sh: every experiment)

Python equivalents:
  ntpflow.train(ntpflow.TrainConfig(task="majority", regime="myopic", seed=0), "runs/maj-myopic-s0")
  ntpflow.runs.probe.probe_run(ntpflow.Run.open("runs/maj-myopic-s0"))
  ntpflow.attribute("runs/maj-myopic-s0", ntpflow.parse_sites("1-2:2-19"), ["is_majority_0"])
  ntpflow.experiments.report_all.run_experiment("toy", "small", "results/toy-small")
"""

REPRODUCE_EXAMPLES = """
examples (times measured on a 2-core CPU):
  ntpflow reproduce toy --scale smoke                          # ~1 min: the pipeline, not the science
  ntpflow reproduce toy --scale small --out results/toy-small  # ~30 min
  ntpflow reproduce toy --scale medium --tasks cond_majority --regimes vanilla --no-replays
                                                               # gates first (~1-1.5 h), replays later
  ntpflow reproduce othello --scale small
  ntpflow reproduce stories --scale small                      # ~40 min, on the shipped TinyStories sample
  ntpflow reproduce llm --scale small                          # under an hour
  ntpflow reproduce all --scale small                          # all four + one report.html: ~2.5-3 h
  ntpflow reproduce all --scale paper --device cuda            # the paper's sizes: a GPU and the hub

Each experiment writes OUT/report.md, OUT/report.html, OUT/summary.json and OUT/figures/ (docs/outputs.md);
rerun the same command to resume an interrupted run.

Python equivalent:
  from ntpflow.experiments.report_all import run_experiment, run_all
  run_experiment("toy", "small", "results/toy-small"); run_all("small", "results/all-small")
"""

log = logging.getLogger("ntpflow")

# The demo's "small size": about a minute per regime on a 2-core CPU.
DEMO_SETTINGS = ["steps=600", "n_train=25600", "n_eval=4096", "eval_every=200", "ckpt_every=200"]


def _config(args, task=None, regime=None, extra_set=()):
    """TrainConfig from the command line; ``task``/``regime`` override the flags, ``extra_set`` goes before --set."""
    fields = {"task": task or getattr(args, "task", None), "regime": regime or getattr(args, "regime", None),
              "seed": args.seed, "device": args.device}
    base = {k: v for k, v in fields.items() if v is not None}
    return config_from([*extra_set, *(args.set or [])], **base)  # built once: a task's own parameters included


def cmd_train(args) -> int:
    """``ntpflow train``: train (or resume) one run, log its final scores and print its directory; with ``--workers
    N``, start N workers that train it together (``ntpflow.runs.workers``)."""
    cfg = _config(args)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers takes a positive count, not {args.workers}")
    if args.workers and args.workers > 1 and worker_env() is None:
        if not args.account:
            raise ValueError("--workers trains with the account only (--account SITES): the workers share its "
                             "readout")
        argv = list(args.argv)
        at = argv.index("--workers")
        return launch(args.workers, argv[:at] + argv[at + 2:])
    task = cfg.task.rpartition(":")[2].rpartition(".")[2]  # a task's own class name when named by its import path
    if cfg.task.startswith("file:"):  # a task file: its name and a digest of its path, unique to the file
        path = cfg.task.removeprefix("file:")
        task = f"{Path(path).stem}-{hashlib.sha256(path.encode()).hexdigest()[:6]}"
    out = Path(args.out or f"runs/{task}-{cfg.regime}-s{cfg.seed}")
    track = [t for t in (args.track or "").split(",") if t]
    if (args.readout is not None or args.chunks is not None) and not args.account:
        raise ValueError("--readout and --chunks go with --account SITES")
    if args.account_types and not args.account:
        raise ValueError("--account-types goes with --account SITES")
    account = None if not args.account else AccountSpec(
        tuple(parse_sites(args.account)), args.readout, args.chunks if args.chunks is not None else DEFAULT_CHUNKS,
        types=tuple(f for f in (args.account_types or "").split(",") if f))
    run = train(cfg, out, progress=not args.quiet and worker_env() is None, track=track,
                force_unlock=args.force_unlock, account=account)
    leave_workers()
    if is_follower():
        return 0  # worker 0 reports
    final = run.metrics()[-1]
    scores = " ".join(f"{k}={final[k]:.4f}" for k in ("eval_loss", "legal_acc", "first_acc") if k in final)
    log.info("finished %s: %s", out, scores)
    print(out)
    return 0


def cmd_probe(args) -> int:
    """``ntpflow probe``: fit ridge probes of a run's weights, print a header (run, weights, step) and each
    feature's r table beside the untrained baseline's (the step-0 weights), and write them all to r.csv."""
    run = Run.open(args.run_dir)
    if not run.done and args.weights == "final":
        raise ValueError(f"{args.run_dir} has not finished training; probe a checkpoint with --weights STEP")
    feature = check_feature(run, args.feature) if args.feature else None  # before anything is fitted or written
    device = args.device or "auto"
    probes = probe_run(run, args.weights, device=device)
    named = {"final": run.cfg.steps, "init": 0}
    step = named[str(args.weights)] if str(args.weights) in named else int(args.weights)
    baseline = None if str(args.weights) == "init" else load_or_probe(run, "init", device)
    csv = write_r_table(run.probes_dir(args.weights), probes, baseline,
                        {"run": str(run.dir), "weights": str(args.weights), "step": int(step), "stamp": stamp()})
    print(f"run {run.dir} ({run.cfg.task}, {run.cfg.regime}, seed {run.cfg.seed}): weights {args.weights} "
          f"(step {step} of {run.cfg.steps}); ridge probes' test Pearson r"
          + ("" if baseline is None else ", beside the untrained model's (step 0) in brackets"))
    for name in [feature] if feature else probes.feature_names:
        print(probe_table(probes, name, baseline=baseline))
    print(f"every feature's table: {csv}")
    return 0


def cmd_attribute(args) -> int:
    """``ntpflow attribute``: replay a run (or members of one run group, in one replay), tracking component influences
    at the sites; print the out folder(s)."""
    features = [f for f in args.features.split(",") if f] if args.features else None
    sites, dirs, directions = parse_sites(args.sites) if args.sites else [], args.run_dir, _directions(args)
    if not sites and not directions and len(dirs) == 1 and not args.group:
        sites = account_sites(Run.open(dirs[0]))  # a run trained with --account: the sites it kept
    if not sites and not directions:
        raise ValueError("give --sites (the task's features) and/or --direction / --sae (directions of your own)")
    spec = AttributionSpec(sites, features, directions=directions or {}, reading=_reading(args),
                           readout=args.readout, sgd_rows=not args.adam_only, matrices=args.matrices,
                           replay=args.replay)
    if args.group or len(dirs) > 1:
        spec.check_group()
    if args.group:
        if len(dirs) != 1:
            raise ValueError("--group takes one run dir, a member of the group")
        dirs = group_dirs(Run.open(dirs[0]))
    how = {"device": args.device or "auto", "progress": not args.quiet, "force_unlock": args.force_unlock}
    if len(dirs) == 1 and not args.group:
        outs = [attribute(dirs[0], spec, out_dir=args.out, **how)]
    elif args.out:
        raise ValueError("--out takes a single run dir; each member of a group writes RUN_DIR/attribution")
    else:
        outs = attribute_group(dirs, spec, **how)
    for out in outs:  # the answer (on stderr, with the closing lines): each site × feature's split of the change
        summary = read_json(AttributionDir(out).summary)
        lines = answer_lines(summary["probes"], summary.get("own_rows", "adam"))
        if lines:
            logging.getLogger("ntpflow").info(
                f"{out}: the split of each change (shares of the {summary.get('own_rows', 'adam')} reading; "
                "+ = toward the final value)\n" + "\n".join(f"  {line}" for line in lines))
    print("\n".join(map(str, outs)))  # stdout: the folders, one a line
    return 0


def _directions(args) -> dict:
    """{name: (Site, path or (path, key) or tensor)} of ``--direction`` and ``--sae --latents --sae-site``."""
    out: dict = {}
    for text in args.direction or []:
        name, site, path, key = parse_direction(text)
        if name in out:
            raise ValueError(f"direction {name!r} given twice")
        out[name] = (site, (path, key))
    sae = (args.sae, args.latents, args.sae_site)
    if any(x is not None for x in sae):
        if None in sae:
            raise ValueError("--sae, --latents and --sae-site go together, e.g. --sae SAE_DIR --latents 3,17 "
                             "--sae-site 1:5")
        for name, d in sae_directions(args.sae, _int_list(args.latents, "--latents"), Site.parse(args.sae_site)).items():
            if name in out:
                raise ValueError(f"direction {name!r} given twice")
            out[name] = d
    return out


def cmd_balance(args) -> int:
    """``ntpflow balance``: replay a run and split the gap between its integrated full influence and the mismatch
    removed on held-out data; print the out folder and one line per probe and mismatch."""
    features = [f for f in args.features.split(",") if f] if args.features else None
    out = audit_balance(args.run_dir, parse_sites(args.sites), features, out_dir=args.out, n_held_out=args.held_out,
                        device=args.device or "auto", progress=not args.quiet)
    print(out)
    for e in read_json(AttributionDir(out).summary)["probes"]:
        print(f"{Path(args.run_dir).name} ⟨{e['layer']}, {e['pos']}⟩ {e['feature']} {e['mismatch']}: Σ full influence {e['full_batch']:.4g} "
              f"= removed on held-out {e['removed_held_out']:.4g} + same batch {e['same_batch']:.4g} "
              f"+ beyond first order {e['beyond_first_order']:.4g}; read at each step's midpoint: "
              f"{e['midpoint_held_out']:.4g} on held-out")
    return 0


def cmd_breakdown(args) -> int:
    """``ntpflow breakdown``: split chosen steps' component influences over the parameter tensors; print the out
    folder (the lines per step, site and feature go to the log)."""
    run = Run.open(args.run_dir)
    features = [f for f in args.features.split(",") if f] if args.features else None
    out = breakdown(args.run_dir, parse_steps(args.steps, run.cfg.steps), parse_sites(args.sites), features,
                    readout=args.readout, warm=args.warm, points=args.points, out_dir=args.out,
                    device=args.device or "auto")
    print(out)
    return 0


def _int_list(text: str, option: str) -> tuple[int, ...]:
    """``"0,1,2"`` → (0, 1, 2); anything else is a one-line error naming ``option``."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, got {text!r}") from None


def cmd_reproduce(args) -> int:
    """``ntpflow reproduce``: run one experiment (or all) at a scale and print the report's path."""
    check_extras(args.experiment)  # before hours of training, not after
    reading = _reading(args)
    if reading != "exact" and args.experiment == "llm":
        raise ValueError(f"--{reading} applies to the experiments with replays: toy, othello, stories, all")
    if args.device:
        resolve_device(args.device)
    out = Path(args.out or f"results/{args.experiment}-{args.scale}")
    options = {"workers": args.workers, "device": args.device or "auto", "progress": not args.quiet,
               "corpus": args.corpus, "tasks": tuple(args.tasks.split(",")) if args.tasks else None,
               "regimes": tuple(args.regimes.split(",")) if args.regimes else None,
               "seeds": _int_list(args.seeds, "--seeds") if args.seeds else None,
               "replays": False if args.no_replays else None, "reading": None if reading == "exact" else reading}
    if args.experiment == "all":
        print(run_all(args.scale, out, **options))
    else:
        print(run_experiment(args.experiment, args.scale, out, **options))
    return 0


def cmd_sweep(args) -> int:
    """``ntpflow sweep``: run (or resume) a sweep spec and print the path of its results.parquet."""
    spec = SweepSpec.load(args.spec)
    out = run_sweep(spec, args.out or f"sweeps/{spec.name}", executor=args.executor, workers=args.workers,
                    progress=not args.quiet)
    print(out / "results.parquet")
    failed = failures(spec, out)
    if failed:
        print(f"ntpflow: error: {len(failed)} of {len(spec.points())} runs failed ({', '.join(failed)}); their "
              "errors are in results.parquet and RUN/FAILED; rerun the same command to retry them", file=sys.stderr)
        return 1
    return 0


def cmd_qscan(args) -> int:
    """``ntpflow qscan [train|scan] ...``: Q(w) of SAE latents by ablation (options of ``ntpflow.llm.qscan_cli``)."""
    return qscan_main(args.options)


def cmd_demo(args) -> int:
    """``ntpflow demo``: train majority in the four regimes and print the probe table (untrained row too)."""
    out = Path(args.out)
    rows = {}
    for regime in REGIMES:
        cfg = _config(args, task="majority", regime=regime, extra_set=DEMO_SETTINGS)
        run = train(cfg, out / f"majority-{regime}-s{cfg.seed}", progress=not args.quiet)
        if regime == "vanilla":
            rows["untrained"] = load_or_probe(run, "init", cfg.device)
        rows[regime] = load_or_probe(run, "final", cfg.device)
    print(demo_table(rows))
    return 0


# Modules each experiment needs beyond the core dependencies, with the extra that installs them.
EXTRAS = {"toy": {"matplotlib": "plot"}, "othello": {"matplotlib": "plot"},
          "stories": {"matplotlib": "plot", "spacy": "stories", "tokenizers": "stories"},
          "llm": {"matplotlib": "plot", "transformers": "llm", "sae_lens": "llm", "scipy": "llm"}}


def check_extras(experiment: str) -> None:
    """Raise ValueError naming the missing packages of ``experiment`` (or of every one, for ``all``)."""
    import importlib.util

    wanted = {}
    for name in EXTRAS if experiment == "all" else [experiment]:
        wanted |= EXTRAS.get(name, {})
    missing = {m: extra for m, extra in wanted.items() if importlib.util.find_spec(m) is None}
    if missing:
        extras = ",".join(sorted(set(missing.values())))
        raise ValueError(f"reproduce {experiment} needs {', '.join(sorted(missing))}: pip install 'ntpflow[{extras}]'")


def demo_table(rows: dict) -> str:
    """Mean over v of Pearson r of ``is_majority_v`` at input positions 1..9 (NTP-useless), per layer."""
    first = next(iter(rows.values()))
    names = [n for n in first.feature_names if n.startswith("is_majority")]
    idx = [first.feature_index(n) for n in names]
    positions = list(range(1, 10))
    lines = ["probe quality (test Pearson r, mean over v) of is_majority_v at input positions, "
             "where it is NTP-useless"]
    for layer in range(first.r.shape[0]):
        lines.append(f"\nlayer {layer}")
        lines.append(f"{'regime':<15}" + "".join(f"{'p' + str(p):>6}" for p in positions) + f"{'mean':>7}")
        for name, probes in rows.items():
            r = probes.r[layer][positions][:, idx].float().nanmean(-1)
            lines.append(f"{name:<15}" + "".join(f"{v:6.2f}" for v in r.tolist()) + f"{r.nanmean().item():7.2f}")
    return "\n".join(lines)


class _Help(argparse.HelpFormatter):
    """Descriptions and epilogs line by line: commands and code (indented lines, ``example:`` and ``Python``
    lines) as written, any other line a paragraph wrapped to the terminal."""

    def _fill_text(self, text, width, indent):
        out = []
        for line in text.strip("\n").splitlines():
            if not line.strip() or line[0].isspace() or line.startswith(("example", "Python")):
                out.append(indent + line if line.strip() else "")
            else:
                out += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent,
                                     break_long_words=False, break_on_hyphens=False)
        return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``ntpflow`` command and its subcommands."""
    p = argparse.ArgumentParser(prog="ntpflow", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=_Help)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or stage lines, warnings only")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    p.add_argument("--version", action="version", version=f"ntpflow {__version__}")
    sub = p.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for add in (_add_train, _add_probe, _add_attribute, _add_report, _add_discover, _add_balance, _add_breakdown,
                _add_reproduce,
                _add_sweep, _add_qscan, _add_demo):
        add(sub)
    return p


def _common(sp: argparse.ArgumentParser) -> None:
    """The options that every training command shares."""
    sp.add_argument("--seed", type=int, help="seed of initialisation and data order (default 0)")
    sp.add_argument("--device", help="auto (default), cpu, cuda, cuda:1, ...")
    sp.add_argument("--set", nargs="+", metavar="KEY=VALUE", help="override any TrainConfig field")


def _add_train(sub) -> None:
    """The ``ntpflow train`` subcommand."""
    t = sub.add_parser("train", help="train one model into a run folder (resumes)",
                       description="Train one model into a run directory; rerun the same command to resume an "
                                   "interrupted run.",
                       epilog=TRAIN_EXAMPLES, formatter_class=_Help)
    t.add_argument("--task", help="majority | cond_majority | othello | stories (stories needs --set corpus=...) | "
                   "package.module:Class, a task of your own (docs/tasks.md)")
    t.add_argument("--regime", help="vanilla | myopic | untied | myopic-untied")
    t.add_argument("--out", help="run directory (default runs/<task>-<regime>-s<seed>)")
    t.add_argument("--track", help="extra metric sinks besides metrics.jsonl: tensorboard, wandb (comma-separated)")
    t.add_argument("--force-unlock", action="store_true",
                   help="take over the run directory's lock left by a process on another host that is gone")
    t.add_argument("--account", metavar="SITES",
                   help="keep the exact account at these sites while training (LAYER:POS list or ranges, e.g. "
                        "1:4,1:14): attribute, --direction, --sae and discover then read RUN/account instead of "
                        "replaying the run (docs/balance.md#the-account-while-training-in-run)")
    t.add_argument("--readout", type=int, metavar="N",
                   help="with --account: the readout set, the first N evaluation sequences (default the batch size, "
                        "at most 256)")
    t.add_argument("--chunks", type=int, metavar="N",
                   help="with --account: at most N chunks of steps kept (the curves' resolution; default 100)")
    t.add_argument("--account-types", metavar="FEATURES",
                   help="with --account: also keep the per-type rows of these features (comma-separated), for a task "
                        "that labels its features by type on each example, as Othello's squares (empty / NTP-useless "
                        "/ NTP-useful)")
    t.add_argument("--workers", type=int, metavar="N",
                   help="with --account: N workers on this machine (torch.distributed: gloo on a CPU, NCCL on GPUs) "
                        "that split the batch and the account's readout; or start it as torchrun --nproc-per-node N -m ntpflow "
                        "train ...")
    _common(t)
    t.set_defaults(fn=cmd_train)


def _add_probe(sub) -> None:
    """The ``ntpflow probe`` subcommand."""
    pr = sub.add_parser("probe", help="fit ridge probes of a finished run and print r tables",
                        description="Fit ridge probes of a run's weights and print each feature's r table beside "
                                    "the untrained model's; all of them go to r.csv.",
                        epilog="example: ntpflow probe runs/maj-myopic-s0 --feature 'is_majority_0'\n"
                               "Python: ntpflow.runs.probe.probe_run(ntpflow.Run.open('runs/maj-myopic-s0'))",
                        formatter_class=_Help)
    pr.add_argument("run_dir", help="a finished run directory (ntpflow train)")
    pr.add_argument("--weights", default="final", help="final (default), init, or a checkpoint step")
    pr.add_argument("--feature", help="print only this feature")
    pr.add_argument("--device", help="auto (default), cpu, cuda, ...")
    pr.set_defaults(fn=cmd_probe)


def _add_attribute(sub) -> None:
    """The ``ntpflow attribute`` subcommand."""
    a = sub.add_parser("attribute", help="replay a run, tracking each gradient component's influence",
                       description="Replay a finished run (or the members of one run group, in one replay) and "
                                   "track each gradient component's influence on the features at the sites.",
                       epilog="example: ntpflow attribute runs/maj-vanilla-s0 --sites 1-2:2-19 "
                              "--features 'is_majority_0'\n"
                              "Python: ntpflow.attribute('runs/maj-vanilla-s0', "
                              "ntpflow.parse_sites('1-2:2-19'), ['is_majority_0'])\n"
                              "several members of one run group (or --group): one replay of the group tracks them "
                              "all; Python: ntpflow.replay.attribution.attribute_group([RUN_DIR, ...], sites, features)\n"
                              "writes OUT/influence.parquet and OUT/summary.json (schemas: docs/outputs.md); "
                              "positive influence = moved the feature toward its final value",
                       formatter_class=_Help)
    a.add_argument("run_dir", nargs="+", help="a finished run directory (ntpflow train), or several members of one "
                   "run group, tracked in one replay of the group")
    a.add_argument("--group", action="store_true",
                   help="track every member of RUN_DIR's run group in one replay, over the run axis (one vmapped "
                        "pass per step; values equal to a lone replay's to rounding; docs/run-groups.md)")
    a.add_argument("--sites", help="LAYER:POS list or ranges, e.g. 1:5,2:7, 1-2:2-19 or blocks.0.hook_resid_post:4 "
                   "(= 1:4), where the task's features are tracked; without it, the sites of the run's account "
                        "(train --account), else only --direction / --sae")
    a.add_argument("--features", help="comma-separated feature names (default: all of the task's)")
    a.add_argument("--direction", action="append", metavar="NAME=K:I:PATH[:KEY]",
                   help="a direction of your own tracked as feature NAME at site K:I: a .npy vector [d_model], or "
                        "PATH.safetensors:KEY (repeatable; docs/own-question.md)")
    a.add_argument("--sae", metavar="DIR", help="an SAE folder (SAELens layout: cfg.json + sae_weights.safetensors): "
                   "its decoder rows --latents at --sae-site are tracked as features sae_<latent>")
    a.add_argument("--latents", help="comma-separated SAE latent ids, with --sae")
    a.add_argument("--sae-site", metavar="K:I", help="the site the SAE's latents are read at, with --sae")
    a.add_argument("--out", help="output folder (default RUN_DIR/attribution)")
    a.add_argument("--adam-only", action="store_true",
                   help="write the Adam rows only, not the SGD variant's (about 30%% less tracking work)")
    _add_reading(a)
    a.add_argument("--readout", type=int, metavar="N",
                   help="the exact account (the default): R and R_c read on the first N evaluation sequences "
                        "(default 256, or all of them if fewer), each step's change of them measured and split by "
                        "a path integral along the step; summary.json gives each row's residual, the last line "
                        "PASS/FAIL against 1%% (docs/balance.md)")
    a.add_argument("--matrices", action="store_true",
                   help="also save every site's influence matrices (OUT/matrices.safetensors; the exact account "
                        "only), from which any direction's influence is read afterwards and ntpflow discover finds "
                        "the directions each component moved most (docs/discover.md)")
    a.add_argument("--replay", action="store_true",
                   help="replay the run even where it was trained with --account (which attribute otherwise reads)")
    a.add_argument("--force-unlock", action="store_true",
                   help="take over the output folder's lock left by a process on another host that is gone")
    a.add_argument("--device", help="auto (default), cpu, cuda, ...")
    a.set_defaults(fn=cmd_attribute)


def cmd_discover(args) -> int:
    """``ntpflow discover``: each component's top directions at a site from an attribution's influence matrices;
    print the output folder and its markdown."""
    out = discover(args.run_dir, parse_site_arg(args.site), attribution_dir=args.attribution, out_dir=args.out,
                   top=args.top, null_draws=args.null, seed=args.seed, rcond=args.rcond,
                   features=args.features.split(",") if args.features else None)
    print(out)
    print((out / "discover.md").read_text())
    return 0


def parse_site_arg(text: str):
    """One site LAYER:POS (ValueError otherwise)."""
    sites = parse_sites(text)
    if len(sites) != 1:
        raise ValueError(f"--site takes one LAYER:POS, got {text!r}")
    return sites[0]


def _add_discover(sub) -> None:
    """The ``ntpflow discover`` subcommand."""
    d = sub.add_parser("discover", help="the directions each component moved most (needs --matrices)",
                       description="The directions whose mismatch each component removed most, from the influence "
                                   "matrices of attribute --readout N --matrices, compared with the run's probes.",
                       epilog="example: ntpflow discover runs/cmaj-s0 --site 1:4\n"
                              "Python: ntpflow.replay.discover.discover('runs/cmaj-s0', ntpflow.Site(1, 4))\n"
                              "writes OUT/discover.json and OUT/discover.md (docs/discover.md)",
                       formatter_class=_Help)
    d.add_argument("run_dir", help="a finished run whose attribution holds influence matrices")
    d.add_argument("--site", required=True, help="LAYER:POS, one of the attributed sites")
    d.add_argument("--attribution", help="the attribution folder (default RUN_DIR/attribution)")
    d.add_argument("--out", help="output folder (default ATTRIBUTION/discover/LAYER_POS)")
    d.add_argument("--features", help="compare with these probes only: comma-separated names or shell patterns, "
                   "e.g. 'sq_[C-F][3-6]' (default: all the run's probes)")
    d.add_argument("--top", type=int, default=3, help="directions per component (default 3)")
    d.add_argument("--null", type=int, default=1000, help="random subspaces drawn for the null (default 1000)")
    d.add_argument("--seed", type=int, default=0, help="seed of the null's draws (default 0)")
    d.add_argument("--rcond", type=float, default=1e-4,
                   help="S_0's active subspace: eigenvalues above rcond × the largest (default 1e-4)")
    d.set_defaults(fn=cmd_discover)


def _add_reading(parser) -> None:
    """``--paper`` / ``--midpoint``: how replays read the influence, instead of the exact account (the default)."""
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--paper", action="store_true",
                     help="the paper's reading instead of the exact account: R on each step's training batch, its "
                          "gradient at the step's start θ_t (the components then split R's change to first order "
                          "only; docs/balance.md). An attribution folder holds one reading")
    how.add_argument("--midpoint", action="store_true",
                     help="as --paper, with the gradient read at the midpoint of the step taken (second order)")


def _reading(args) -> str:
    """The reading that ``--paper`` / ``--midpoint`` ask for: "paper", "midpoint" or "exact"."""
    return "paper" if args.paper else "midpoint" if args.midpoint else "exact"


def _add_balance(sub) -> None:
    """The ``ntpflow balance`` subcommand."""
    b = sub.add_parser("balance", help="where a run's full influence goes: held-out, same batch, beyond",
                       description="Replay a finished run and split the gap between its integrated full influence "
                                   "and the mismatch removed on held-out data.",
                       epilog="example: ntpflow balance runs/maj-vanilla-s0 --sites 1:4,1:6 --features "
                              "'is_majority_0'\n"
                              "Python: ntpflow.replay.balance.audit_balance('runs/maj-vanilla-s0', "
                              "ntpflow.parse_sites('1:4,1:6'), ['is_majority_0'])\n"
                              "writes OUT/summary.json: per probe and mismatch, Σ full influence = R removed on "
                              "held-out data + a same-batch part + a beyond-first-order part (docs/engine.md)",
                       formatter_class=_Help)
    b.add_argument("run_dir", help="a finished run directory (ntpflow train)")
    b.add_argument("--sites", required=True, help="LAYER:POS list or ranges, e.g. 1:4,1:6 or 1:2-9")
    b.add_argument("--features", help="comma-separated feature names (default: all of the task's)")
    b.add_argument("--held-out", type=int, default=1024,
                   help="size of the held-out set H, the first examples of the eval set (default 1024)")
    b.add_argument("--out", help="output folder (default RUN_DIR/balance)")
    b.add_argument("--device", help="auto (default), cpu, cuda, ...")
    b.set_defaults(fn=cmd_balance)


def cmd_report(args) -> int:
    """``ntpflow report``: the figures and report page of an attribution; print report.md's and report.html's paths."""
    md = write_run_report(args.path)
    print(md)
    print(md.with_suffix(".html"))
    return 0


def _add_report(sub) -> None:
    """The ``ntpflow report`` subcommand."""
    r = sub.add_parser("report", help="one attribution's figures and a self-contained report page",
                       description="Draw an attribution's influence (each component's share of the change, "
                                   "NTP-useful and useless sites apart; cumulative curves) and write a report page.",
                       epilog="example: ntpflow report runs/mine   # its attribution/, or an attribution folder\n"
                              "Python: ntpflow.attribute(...).report(), or .plot('bars') / .plot('curves')\n"
                              "writes ATTRIBUTION/report/: report.md, report.html, summary.json, figures/",
                       formatter_class=_Help)
    r.add_argument("path", help="a run folder with an attribution, or an attribution folder")
    r.set_defaults(fn=cmd_report)


def _add_breakdown(sub) -> None:
    """The ``ntpflow breakdown`` subcommand."""
    b = sub.add_parser("breakdown", help="why a row cancels: chosen steps split over the tensors",
                       description="Why a row cancels: chosen steps' component influences split over the parameter "
                                   "tensors, with the optimizer's scale.",
                       epilog="example: ntpflow breakdown runs/maj-vanilla-s0 --steps 2820-2822 --sites 1:4,1:6,1:8 "
                              "--features is_majority_0\n"
                              "Python: ntpflow.replay.breakdown.breakdown('runs/maj-vanilla-s0', range(2820, 2823), "
                              "ntpflow.parse_sites('1:4'), ['is_majority_0'])\n"
                              "writes OUT/breakdown.parquet (a row per tensor) and OUT/summary.json (each "
                              "component's total and largest tensors per step, site, feature, mismatch, reading)",
                       formatter_class=_Help)
    b.add_argument("run_dir", help="a finished run directory (ntpflow train)")
    b.add_argument("--steps", required=True, help="steps to split, e.g. 2820-2822,1542 (0-based, as in "
                   "influence.parquet)")
    b.add_argument("--sites", required=True, help="LAYER:POS list or ranges, e.g. 1:4,1:6")
    b.add_argument("--features", help="comma-separated feature names (default: all of the task's)")
    b.add_argument("--readout", type=int, metavar="N", help="the readout set (default as attribute: 256)")
    b.add_argument("--warm", type=int, default=200, help="steps of moments summed before the first step "
                   "(default 200: their truncation is at most β1^200, recorded)")
    b.add_argument("--points", type=int, default=8, help="Gauss–Legendre points along each step (default 8)")
    b.add_argument("--out", help="output folder (default RUN_DIR/breakdown)")
    b.add_argument("--device", help="auto (default), cpu, cuda, ...")
    b.set_defaults(fn=cmd_breakdown)


def _add_reproduce(sub) -> None:
    """The ``ntpflow reproduce`` subcommand."""
    rp = sub.add_parser("reproduce", help="reproduce an experiment of the paper and write its report",
                        description="Reproduce an experiment of the paper (or all of them) at a scale and write its "
                                    "report.",
                        epilog=REPRODUCE_EXAMPLES, formatter_class=_Help)
    rp.add_argument("experiment", help="toy | othello | stories | llm | all (every experiment and one report.html)")
    rp.add_argument("--scale", default="smoke", help="smoke (default; CI, minutes) | small (this 2-core CPU: "
                    "30-60 min per experiment, all: ~2.5-3 h) | medium (toy: the paper's model, 5 seeds; othello: a "
                    "world model, two runs of ~3 core-hours each; hours on a CPU) | medium-6x6 (othello: the 6×6 "
                    "fallback board, not the paper's setting) | paper (the paper's sizes: GPU)")
    rp.add_argument("--out", help="results folder (default results/<experiment>-<scale>)")
    rp.add_argument("--workers", type=int, help="parallel runs (default: number of cores; othello: its two training "
                    "runs side by side, default 2 on a CPU, 1 on a GPU; on a CPU each run trains on one torch thread, "
                    "so its result does not depend on this)")
    rp.add_argument("--corpus", help="stories: a folder or file of stories, 'sample' (the TinyStories sample shipped in the "
                    "package, ntpflow/data/tinystories-sample), 'generated[:N]' or 'hf' (default: generated at smoke, "
                    "sample at small, hf at paper)")
    rp.add_argument("--tasks", help="toy only: comma-separated subset of majority,cond_majority (default: both)")
    rp.add_argument("--regimes", help="toy only: comma-separated subset of vanilla,myopic,untied,myopic-untied "
                    "(default: all four)")
    rp.add_argument("--seeds", help="toy only: comma-separated subset of the scale's seeds, for every regime "
                    "(default: all)")
    _add_reading(rp)
    rp.add_argument("--no-replays", action="store_true",
                    help="toy and othello (all: both; stories and llm ignore it): train and probe, skip only the "
                    "influence (without the flag the tracked runs train with the exact account kept while training; "
                    "hours at medium scale; othello still trains its myopic run and runs the fragility test); the "
                    "influence claims are then not testable. Rerun without it to add them (by replaying the runs)")
    rp.add_argument("--device", help="auto (default), cpu, cuda, ...")
    rp.set_defaults(fn=cmd_reproduce)


def _add_sweep(sub) -> None:
    """The ``ntpflow sweep`` subcommand."""
    sw = sub.add_parser("sweep", help="a grid of runs from a JSON/TOML spec (re-entrant)",
                        description="A grid of runs (seeds x regimes x tasks x settings) from a JSON or TOML spec.",
                        epilog="example: ntpflow sweep sweep.toml --workers 2\n"
                               "Python: ntpflow.runs.sweep.run_sweep('sweep.toml', 'sweeps/NAME', workers=2)\n"
                               "finished runs are skipped: rerun the same command to resume or retry failed runs",
                        formatter_class=_Help)
    sw.add_argument("spec", help="sweep spec (.json or .toml); see ntpflow.runs.sweep")
    sw.add_argument("--out", help="sweep folder (default sweeps/<name>)")
    sw.add_argument("--executor", default="local", help="local (default) | submitit (Slurm) | submitit-local")
    sw.add_argument("--workers", type=int, default=2, help="runs at a time (default 2)")
    sw.set_defaults(fn=cmd_sweep)


def _add_qscan(sub) -> None:
    """The ``ntpflow qscan`` subcommand."""
    q = sub.add_parser("qscan", help="Q(w) of SAE latents of a language model, by ablation",
                       add_help=False)
    q.add_argument("options", nargs=argparse.REMAINDER, help="options of the scan (ntpflow qscan -h lists them)")
    q.set_defaults(fn=cmd_qscan)


def _add_demo(sub) -> None:
    """The ``ntpflow demo`` subcommand."""
    d = sub.add_parser("demo", help="majority in the four regimes, small (~5 min); a probe table",
                       description="Train the majority task in the four regimes at a small size and print the probe "
                                   "table.",
                       epilog="example: ntpflow demo --out runs/demo   # ~5 min on 2 cores\n"
                              "The quick look at the paper's first claim. scripts/demo.sh instead sets up the "
                              "environment and runs every experiment at smoke size (ntpflow reproduce all "
                              "--scale smoke).", formatter_class=_Help)
    d.add_argument("--out", default="runs/demo", help="folder of the four runs (default runs/demo)")
    _common(d)
    d.set_defaults(fn=cmd_demo)


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status (2 on error, 130 on ^C)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "qscan":  # its options belong to its own parser
        args.options = unknown + args.options
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.WARNING if args.quiet or is_follower() else logging.INFO, format="%(message)s")
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("ntpflow: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error ends in one line; --debug shows the traceback
        if args.debug:
            raise
        expected = isinstance(e, ValueError | OSError | RuntimeError | ImportError)
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError's str() adds quotes
        msg = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        if expected:
            print(f"ntpflow: error: {msg}", file=sys.stderr)
            return 2
        print(f"ntpflow: internal error ({type(e).__name__}): {msg}; rerun with --debug for the traceback",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
