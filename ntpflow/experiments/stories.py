"""The TinyStories reproduction (docs/paper.md#tinystories, claim 4): a small LM trained vanilla and myopic.

``run_stories(scale, out)`` trains every (regime, seed) on 64-token story windows, fits ridge probes for the 22
features (10 tags, 10 dependency labels, ``pos_int``, ``pos_prop``) on the final and the untrained model, replays
each run with influence tracking at the tracked sites × all 22 features, samples continuations of a few held-out
story openings from each regime's first-seed model, gathers everything into ``out/data.json`` and writes the report
(``ntpflow.experiments.stories_report``). Every stage is resumable and skipped when finished, so an interrupted call
continues where it stopped and a finished one only rewrites the report.

Layer/position convention: ``resid[0]`` = embeddings, ``resid[k]`` = after block k (pre-final-LayerNorm at
k = n_layer); a site ⟨k, p⟩ is ``resid[k]`` at window position p. Logits at p predict token p+1. There is no BOS:
position 0 is the window's first token, and probes cover positions 1..63 (as the reference).

Output folder::

    runs/<regime>-s<seed>/   one training run each (config, weights, probes/, probes_init/, attribution/)
    samples.json             sampled continuations, side by side (see ``sample_continuations``)
    data.json                tidy records for the report (schema in ``ntpflow.experiments.stories_report``)
    report.md  report.html  summary.json  figures/
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ntpflow.experiments.formats import curve_steps, reading_rows
from ntpflow.experiments.parallel import one_run, run_jobs, run_threads
from ntpflow.experiments.scales import resolve_scale, site_grid
from ntpflow.experiments.stories_report import write_report
from ntpflow.files import ensure_writable_dir, read_json, resolve_device, write_json
from ntpflow.model.sampling import sample
from ntpflow.model.sites import Site
from ntpflow.probes import ProbeSet
from ntpflow.replay.attribution import influence_read_at
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.data import make_datasets
from ntpflow.runs.run import Run, task_for
from ntpflow.stats import finite_or_none as _finite
from ntpflow.tasks import Stories
from ntpflow.tasks.stories import FEATURE_GROUPS, FEATURE_NAMES
from ntpflow.tasks.stories.corpus import sample_dir
from ntpflow.tasks.stories.tokenizer import META_FILE as TOKENIZER_META

log = logging.getLogger(__name__)

REGIMES = ("vanilla", "myopic")
CORPUS_HELP = ("pass --corpus PATH (a folder with train.txt and valid.txt, stories separated by <|endoftext|>, or "
               "JSON lines), --corpus sample (the TinyStories sample shipped in the package), --corpus hf "
               "(TinyStoriesV2-GPT4 from the hub) or --corpus generated:N; in Python "
               "run_stories(scale, out, corpus=...)")


@dataclass(frozen=True)
class SamplingSpec:
    """Continuations of ``n_prompts`` held-out story openings: the first ``prompt_len`` tokens of the first eval
    stories that have at least ``prompt_len + n_new`` tokens, extended by ``n_new`` tokens (temperature, top-k);
    the draw for prompt j uses ``torch.Generator().manual_seed(seed + j)``, the same for both regimes."""

    n_prompts: int = 4
    prompt_len: int = 16
    n_new: int = 48
    temperature: float = 0.7
    top_k: int | None = 40
    seed: int = 1234


@dataclass(frozen=True)
class StoriesScale:
    """Settings of one scale.

    ``corpus``: the corpus source (``ntpflow.tasks.stories.load_corpus``), or None where the user must choose it (a
    local copy of TinyStories is the user's, not the project's); ``train``: TrainConfig overrides shared by all
    runs; ``sites``: tracked residual sites (all 22 features at each); ``curve_every``: step stride of the stored
    influence curves; ``tracked``: the regimes whose runs are replayed (the influence claims read vanilla's only;
    the other regimes' runs are trained and probed).
    """

    name: str
    corpus: str | None
    seeds: tuple[int, ...]
    sites: tuple[Site, ...]
    train: dict = field(default_factory=dict)
    sampling: SamplingSpec = SamplingSpec()
    curve_every: int = 10
    tracked: tuple[str, ...] = ("vanilla", "myopic")


SCALES = {
    # the paper (docs/paper.md#tinystories): 4 layers, d 128, 4 heads, T 64, batch 256, 1000 steps, lr 1e-3, 10 seeds,
    # 300,000 training windows of TinyStoriesV2-GPT4 from the hub (30,000 eval windows), tracked positions 30-39 at
    # layers 1-4 (the paper splits them over two runs of 5 positions; here one replay tracks all 40 sites)
    "paper": StoriesScale("paper", "hf", tuple(range(10)), site_grid((1, 2, 3, 4), range(30, 40)),
                          {"n_layer": 4, "d_model": 128, "n_head": 4, "batch_size": 256, "steps": 1000, "lr": 1e-3,
                           "n_train": 300_000, "n_eval": 30_000, "eval_every": 100, "ckpt_every": 100},
                          curve_every=10),
    # this shared 2-core machine in about an hour for both regimes with attribution (two workers of one thread each;
    # a d-64 training step at batch 32 costs ~0.36 CPU-s on an idle core, a replayed step ~2-3x that per tracked
    # site). The TinyStories sample shipped in ntpflow/data/tinystories-sample (corpus "sample"): all 2,315 train windows (every story of >= 64 tokens) and all 1,727 eval
    # windows, a BPE of 4,096 tokens trained on the train split; 4 layers, d 64, 4 heads, batch 32, 300 steps
    # (~4 epochs) at lr 2e-3 (twice the paper's, to get further in few steps), 3 seeds, and two tracked sites inside
    # the paper's layers 1-4 x positions 30-39, ⟨2, 32⟩ and ⟨3, 36⟩, with all 22 features. Measured: 37 min for
    # all six runs, sampling and the report (load ~2; docs/results/stories-small).
    "small": StoriesScale("small", "sample", (0, 1, 2), site_grid((2,), (32,)) + site_grid((3,), (36,)),
                          {"n_layer": 4, "d_model": 64, "n_head": 4, "batch_size": 32, "steps": 300, "lr": 2e-3,
                           "n_train": 2_315, "n_eval": 1_727, "eval_every": 100, "ckpt_every": 50, "log_every": 10},
                          curve_every=5),
    # CI: the generated corpus (a small story grammar) with a 512-token BPE, a 2-layer d 32 model, 30 steps and one
    # site; checks the pipeline, not the science
    "smoke": StoriesScale("smoke", "generated:1000", (0,), (Site(1, 30),),
                          {"n_layer": 2, "d_model": 32, "n_head": 2, "batch_size": 32, "steps": 30, "vocab_size": 512,
                           "n_train": 640, "n_eval": 64, "eval_every": 15, "ckpt_every": 15, "log_every": 10},
                          SamplingSpec(n_prompts=2, prompt_len=8, n_new=60), curve_every=3),
}


def check_corpus(corpus: str | None, scale: str = "") -> None:
    """Fail early, in one line, when no corpus was chosen or a local corpus path is missing (hub and generated
    sources are not checked)."""
    if corpus is None:
        raise ValueError(f"the stories {scale} scale needs a corpus of your choice: {CORPUS_HELP}")
    if corpus == "hf" or corpus.startswith(("hf:", "generated")):
        return
    if corpus == "sample":
        sample_dir()  # present, and every file matches its pinned hash
        return
    if not Path(corpus).exists():
        raise FileNotFoundError(f"corpus {corpus} not found: pass corpus=PATH (a folder with train.txt and "
                                f"valid.txt, stories separated by <|endoftext|>, or JSON lines) or corpus='hf'")


def run_configs(scale: StoriesScale, corpus: str) -> list[TrainConfig]:
    """The TrainConfigs of every regime × seed of ``scale`` on ``corpus``."""
    return [TrainConfig(task="stories", corpus=corpus, regime=r, seed=s, **scale.train)
            for r in REGIMES for s in scale.seeds]


def run_dir_name(cfg: TrainConfig) -> str:
    """Run folder name of a config: ``<regime>-s<seed>``."""
    return f"{cfg.regime}-s{cfg.seed}"


def _prepare_data(cfg: TrainConfig) -> None:
    """Train the tokenizer and featurize the corpus once, in this process, before the workers read the caches."""
    make_datasets(cfg, task_for(cfg))


def run_stories(scale: str | StoriesScale, out: str | Path, *, workers: int | None = None, device: str = "auto",
                progress: bool = True, corpus: str | None = None, reading: str = "exact") -> Path:
    """Run (or resume) every run of ``scale`` into ``out/runs``, sample, gather ``out/data.json`` and write the
    report. ``corpus`` overrides the scale's corpus source (a path, ``"hf"`` or ``"generated:N"``). ``reading``:
    how the replays read the influence (``ntpflow.replay.attribution.attribute``; default: the exact account).
    Returns ``out``.
    """
    scale = resolve_scale(scale, SCALES, StoriesScale)
    corpus = corpus or scale.corpus
    check_corpus(corpus, scale.name)
    corpus = str(corpus)
    out = ensure_writable_dir(out)
    (out / "runs").mkdir(exist_ok=True)
    configs = run_configs(scale, corpus)
    todo = [c for c in configs if not _finished(Run(out / "runs" / run_dir_name(c), c), c.regime in scale.tracked)]
    if todo:
        _prepare_data(todo[0])
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    threads = run_threads(device, workers)
    sites = [(s.layer, s.pos) for s in scale.sites]
    jobs = [(c.to_dict(), str(out / "runs" / run_dir_name(c)), sites if c.regime in scale.tracked else [],
             list(FEATURE_NAMES), device, threads, reading) for c in configs]
    run_jobs(one_run, jobs, workers, f"stories {scale.name}", progress)
    sample_continuations(scale, out, configs, device=device)
    write_json(out / "data.json", gather(scale, out, configs))
    write_report(out)
    return out


def _finished(run: Run, tracked: bool = True) -> bool:
    """Whether ``run`` trained, was probed at step 0 and, if ``tracked``, attributed (its last stages)."""
    return run.done and (run.attribution().done or not tracked) and ProbeSet.saved(run.probes_dir("init"))


# ---------------------------------------------------------------------------------------------------- sampling


def sample_continuations(scale: StoriesScale, out: Path, configs: list[TrainConfig], device: str = "auto") -> dict:
    """Continuations of held-out story openings from each regime's first-seed model; cached in ``out/samples.json``.

    samples.json: ``{"spec": SamplingSpec fields, "seed_model": seed, "prompts": [{"story": eval story index,
    "prompt": text, "reference": the story's true next n_new tokens as text, "continuations": {regime: text}}]}``.
    Recomputed only when the spec or the models' seed changes.
    """
    spec = scale.sampling
    seed = scale.seeds[0]
    path = out / "samples.json"
    if path.exists():
        old = read_json(path)
        if old.get("spec") == asdict(spec) and old.get("seed_model") == seed \
                and set(old.get("regimes", [])) == {c.regime for c in configs}:
            return old
    runs = {c.regime: Run.open(out / "runs" / run_dir_name(c)) for c in configs if c.seed == seed}
    task = next(iter(runs.values())).task
    if not isinstance(task, Stories):
        raise TypeError(f"sample_continuations needs stories runs, got a {type(task).__name__} task")
    tok = task.tokenizer
    need = spec.prompt_len + spec.n_new
    prompts = []
    for i, story in enumerate(task.corpus.eval):
        ids, _ = tok.encode(story)
        if len(ids) >= need:
            prompts.append((i, [int(x) for x in ids[:need]]))
        if len(prompts) == spec.n_prompts:
            break
    dev = resolve_device(device)
    models = {rg: run.load_model("final", dev) for rg, run in runs.items()}
    records = []
    for j, (i, ids) in enumerate(prompts):
        head = ids[:spec.prompt_len]
        conts = {}
        for rg in REGIMES:
            if rg not in models:
                continue
            gen = torch.Generator().manual_seed(spec.seed + j)
            toks = sample(models[rg], head, spec.n_new, temperature=spec.temperature, top_k=spec.top_k,
                          generator=gen)
            conts[rg] = tok.decode(toks[spec.prompt_len:].tolist())
        records.append({"story": i, "prompt": tok.decode(head), "reference": tok.decode(ids[spec.prompt_len:]),
                        "continuations": conts})
    result = {"spec": asdict(spec), "seed_model": seed, "regimes": sorted(models), "prompts": records}
    write_json(path, result)
    return result


# ---------------------------------------------------------------------------------------------------- gather


def gather(scale: StoriesScale, out: Path, configs: list[TrainConfig]) -> dict:
    """Collect tidy records from the finished runs (schema in ``ntpflow.experiments.stories_report``)."""
    group_of = {FEATURE_NAMES[i]: g for g, idx in FEATURE_GROUPS.items() for i in idx}
    tracked_pos = sorted({s.pos for s in scale.sites})
    runs, probes, profiles, influence, curves, influence_centred, mismatch = [], [], [], [], [], [], []
    influence_sgd = []
    tokenizer = None
    for cfg in configs:
        run = Run(out / "runs" / run_dir_name(cfg), cfg)
        key = {"regime": cfg.regime, "seed": cfg.seed}
        done = run.final_record()
        train_losses = [m["loss"] for m in run.metrics() if m["kind"] == "train"]
        runs.append({**key, "eval_loss": done["eval_loss"], "train_loss": train_losses[-1] if train_losses else None,
                     "steps": done["step"]})
        if tokenizer is None:
            meta = run.dir / TOKENIZER_META
            tokenizer = read_json(meta) if meta.exists() else {}
        for weights in ("final", "init"):
            ps = ProbeSet.load(run.probes_dir(weights))
            r = ps.r  # [L+1, T, F]
            for f, name in enumerate(ps.feature_names):
                for layer in range(r.shape[0]):
                    vals = [_finite(r[layer, p, f].item()) for p in ps.positions]
                    at = [_finite(r[layer, p, f].item()) for p in tracked_pos if p in ps.positions]
                    probes.append({**key, "weights": weights, "layer": layer, "feature": name,
                                   "group": group_of.get(name, "other"), "r_mean": _mean(vals),
                                   "r_tracked": _mean(at)})
            for g, idx in FEATURE_GROUPS.items():
                names = [FEATURE_NAMES[i] for i in idx if FEATURE_NAMES[i] in ps.feature_names]
                cols = [ps.feature_names.index(n) for n in names]
                for layer in range(r.shape[0]):
                    for p in ps.positions:
                        profiles.append({**key, "weights": weights, "layer": layer, "pos": p, "group": g,
                                         "r": _mean(_finite(r[layer, p, c].item()) for c in cols)})
        att = run.attribution()
        if not att.done:  # a regime the scale does not replay: trained and probed only
            continue
        own = cfg.own_rows  # the run's own split; the SGD direction ("sgd") beside it where the replay kept it
        rows = reading_rows(att.influence, own)
        last = max(r["step"] for r in rows)
        on_curve = curve_steps((r["step"] for r in rows), scale.curve_every)
        cacc = defaultdict(list)
        for r in rows:
            g = group_of.get(r["feature"], "other")
            if r["optimizer"] != own:  # the SGD direction: its totals of R, for the claims' meaning checks
                if r["step"] == last and r["mismatch"] == "paper":
                    influence_sgd.append({**key, "layer": r["layer"], "pos": r["pos"], "feature": r["feature"],
                                          "group": g, "component": r["component"], "total": r["cumulative"]})
                continue
            if r["step"] == last and r["mismatch"] in ("paper", "centred"):  # the figures and claims: the paper's R
                (influence if r["mismatch"] == "paper" else influence_centred).append(
                    {**key, "layer": r["layer"], "pos": r["pos"], "feature": r["feature"], "group": g,
                     "component": r["component"], "total": r["cumulative"]})
            if r["mismatch"] == "paper" and r["step"] in on_curve:
                cacc[(r["step"], g, r["component"])].append(r["cumulative"])
        for (step, g, c), vals in sorted(cacc.items()):
            curves.append({**key, "step": step + 1, "group": g, "component": c, "cumulative": _mean(vals)})
        if att.summary.exists():
            for p in read_json(att.summary)["probes"]:  # one entry per site x feature x mismatch
                site = {**key, "layer": p["layer"], "pos": p["pos"], "feature": p["feature"]}
                mismatch.append({**site, "mismatch": p.get("mismatch", "paper"),
                                 **{k: _finite(p.get(k)) for k in ("R0_eval", "R0_minus_RT_eval", "offset_share_R0")},
                                 **{k: _finite(p[k]) for k in ("change", "residual") if k in p}})  # exact account
                if p.get("mismatch", "paper") != "paper":  # the influence rows above are the paper's R
                    continue
                influence.append({**site, "group": group_of.get(p["feature"], "other"),
                                  "component": "mismatch_removed", "total": _finite(p.get("R0_minus_RT_eval"))})
    samples_path = out / "samples.json"
    samples = read_json(samples_path) if samples_path.exists() else None
    first = configs[0]
    return {"scale": scale.name, "corpus": first.corpus, "seeds": list(scale.seeds),
            "influence_read_at": influence_read_at([Run(out / "runs" / run_dir_name(c), c).attribution().dir
                                                    for c in configs if c.regime in scale.tracked]),
            "tracked": list(scale.tracked),
            "sites": [[s.layer, s.pos] for s in scale.sites], "train": scale.train,
            "n_layer": first.n_layer, "seq_len": 64,
            "tokenizer": {"source": tokenizer.get("source", "?") if tokenizer else "?",
                          "vocab_size": tokenizer.get("vocab_size") if tokenizer else None,
                          "name": tokenizer.get("name") if tokenizer else None},
            "feature_groups": {g: [FEATURE_NAMES[i] for i in idx] for g, idx in FEATURE_GROUPS.items()},
            "runs": runs, "probes": probes, "profiles": profiles, "influence": influence, "curves": curves,
            "influence_centred": influence_centred, "mismatch": mismatch, "samples": samples,
            "influence_sgd": influence_sgd, "optimizer": configs[0].own_rows}


def _mean(values):
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None
