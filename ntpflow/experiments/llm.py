"""The pretrained-LLM reproduction (docs/paper.md#q, #gemma; claims 5–6 of #claims) and a check beyond the paper.

``run_llm(scale, out)`` runs these stages into ``out``, each skipped when its output exists (resumable; every file
is written atomically):

1. ``sae``: corpus windows (``contexts.safetensors`` + ``contexts.json``), the SAE (``sae/``) and its quality
   (``quality.json``: explained variance, L0, dead latents on train and held-out activations). The ``paper`` scale
   uses GemmaScope instead of training one.
2. ``scan``: Q(w) in both ablation modes (``q_reconstruction.json``, ``q_error-preserving.json``) and the paper's
   statistics (``stats.json``).

Stages 1 and 2 are those of ``ntpflow qscan`` (:mod:`ntpflow.llm.stages`).
3. ``steering``: high-Q vs low-Q latents' steered continuations and their code-likeness (``steering.json``).
4. ``lens``: look-ahead lenses at the SAE's site and the Spearman correlation of Q with the latents' overlap with
   the lens's top singular directions (``lens.json``).
5. ``q_vs_influence``: on a small toy run (``toy_run/``), Q by ablation of probe directions against the replay's
   ``I_pre-cached / I_direct`` (``q_vs_influence.json``).

``meta.json`` records the scale and what was used. ``reuse=DIR`` (explicit, never implied) copies stage-1/2
outputs of an earlier ``ntpflow qscan train`` / ``scan`` (the corpus, ``sae/``, ``quality.json``, and, when DIR holds
a scan, ``q_<mode>.json``, ``stats.json``) into ``out`` instead of recomputing them; ``meta.json["reused_stages"]``
says which.

Scales: ``smoke`` (CI, < 90 s: a tiny random GPT-2 over bytes and a quickly trained SimpleSAE; checks the pipeline,
not the science), ``small`` (SmolLM2-135M-Instruct offline, a TopK SAE trained here with sae-lens, 384 latents
scored; measured on 2 cores: SAE ~20 min at load ~8; at load ~2 (2026-11-30) the scan of 384 latents ~7.5 min,
steering, lens and the toy run ~2 min together; under an hour without ``reuse``), ``paper`` (the reference's
gemma-2-2b + GemmaScope; needs internet and a GPU).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ntpflow.experiments.q_vs_influence import q_vs_influence, toy_sites
from ntpflow.files import ensure_writable_dir, read_json, resolve_device, write_json
from ntpflow.llm.adapters import GEMMA_PRESET, load_gemma_preset, load_model
from ntpflow.llm.lens import _unembedding, fit_lenses, lens_data, lens_q_correlation
from ntpflow.llm.qscan import MODES, QScanConfig, QScanResult
from ntpflow.llm.sae import encoder_matrix
from ntpflow.llm.stages import LLMDir, fit_sae, make_contexts, save_sae_stage, save_scan, scan
from ntpflow.llm.steering import pick_extremes, steer_latents
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.threads import kept_threads
from ntpflow.runs.training import train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LLMScale:
    """Settings of one scale (see the module docstring)."""

    name: str
    model: str  # "tiny" | "smollm2" | "gemma"
    docs_per_domain: int
    windows_per_doc: int
    ctx_len: int
    sae: dict  # {"kind": "simple"|"topk"|"gemmascope", "d_sae", "k", "steps", "batch_size", "lr"}
    n_latents: int  # latents scored (seeded random subset; all if >= d_sae)
    candidates: int
    examples: int
    steer: dict  # {"n_extreme", "prompts", "alphas", "max_new_tokens", "temperature", "n_samples"}
    lens: dict  # {"n_contexts", "ks", "rank_divisors", "ridge"}
    toy: dict  # {"train": TrainConfig overrides, "layers", "positions", "features", "n_sequences"}
    seed: int = 0
    kl_cutoff: float = 0.05  # the reference's filter; the smoke scale's random model needs 0
    notes: str = ""
    extra: dict = field(default_factory=dict)


_PROMPTS = ("", "The", "I think that", "Here is")
_TOY_FEATURES = ("is_majority_0", "is_majority_1", "is_majority_2")

SCALES = {
    "smoke": LLMScale(
        "smoke", "tiny", docs_per_domain=8, windows_per_doc=2, ctx_len=48,
        sae={"kind": "simple", "d_sae": 64, "k": 4, "steps": 150, "batch_size": 256, "lr": 3e-3},
        n_latents=16, candidates=6, examples=2,
        steer={"n_extreme": 3, "prompts": ("", "The"), "alphas": (1.0,), "max_new_tokens": 8, "temperature": 0.0,
               "n_samples": 1},
        lens={"n_contexts": 48, "ks": (1, 2, 3, 4, 5), "rank_divisors": (16, 4), "ridge": 1e-3},
        kl_cutoff=0.0,
        toy={"train": {"steps": 8, "d_model": 16, "n_head": 2, "batch_size": 32, "n_train": 256, "n_eval": 128,
                       "eval_every": 4, "ckpt_every": 4},
             "layers": (1,), "positions": (4, 8, 12, 16), "features": _TOY_FEATURES[:1], "n_sequences": 128},
        notes="CI: checks the pipeline, not the science"),
    "small": LLMScale(
        "small", "smollm2", docs_per_domain=100, windows_per_doc=2, ctx_len=64,
        sae={"kind": "topk", "d_sae": 2048, "k": 32, "steps": 1500, "batch_size": 512, "lr": 4e-4},
        n_latents=384, candidates=16, examples=6,
        steer={"n_extreme": 10, "prompts": _PROMPTS, "alphas": (1.0, 0.25), "max_new_tokens": 20,
               "temperature": 0.0, "n_samples": 1},
        lens={"n_contexts": 200, "ks": (1, 2, 3, 4, 5), "rank_divisors": (64, 16, 4), "ridge": 1e-4},
        # the replay's cost grows quickly with width: d_model 32 and 150 steps keep it to ~2 min here
        toy={"train": {"steps": 150, "d_model": 32, "n_head": 2, "batch_size": 64, "n_train": 4096,
                       "n_eval": 1024, "eval_every": 50, "ckpt_every": 50},
             "layers": (1, 2), "positions": tuple(range(2, 19)), "features": _TOY_FEATURES,
             "n_sequences": 1024},
        notes="SmolLM2-135M-Instruct offline, SAE trained here; about an hour on 2 busy CPU cores (see module doc)"),
    "paper": LLMScale(
        "paper", "gemma", docs_per_domain=2000, windows_per_doc=4, ctx_len=128,
        sae={"kind": "gemmascope"}, n_latents=16384, candidates=24, examples=8,
        steer={"n_extreme": 100, "prompts": ("",), "alphas": (1.0, 0.25), "max_new_tokens": 20,
               "temperature": 1.0, "n_samples": 64},
        lens={"n_contexts": 2000, "ks": (1, 2, 3, 4, 5), "rank_divisors": (64, 16, 4), "ridge": 1e-4},
        toy={"train": {"steps": 3000, "d_model": 128, "n_train": 102_400, "n_eval": 10_240, "eval_every": 500,
                       "ckpt_every": 500},
             "layers": (1, 2), "positions": tuple(range(2, 19)), "features": _TOY_FEATURES, "n_sequences": 4096},
        notes="the reference's gemma-2-2b + GemmaScope layer_15/width_16k/canonical; needs internet and a GPU"),
}


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[llm] {msg}", file=sys.stderr, flush=True)


def _check_online(timeout: float = 3.0) -> None:
    """Raise a one-line RuntimeError unless huggingface.co is reachable and a CUDA GPU is present."""
    msg = ("the llm 'paper' scale needs internet access (gemma-2-2b and GemmaScope from huggingface.co) and a GPU; "
           "use --scale small offline")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise RuntimeError(msg + " (HF_HUB_OFFLINE=1)")
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        raise RuntimeError(msg + " (huggingface.co unreachable)") from None
    if not torch.cuda.is_available():
        raise RuntimeError(msg + " (no CUDA GPU)")


class _Session:
    """Lazily loaded model / SAE / contexts shared by the stages of one call."""

    def __init__(self, scale: LLMScale, out: Path, device: str):
        self.scale, self.out, self.device = scale, out, device
        self.files = LLMDir(out)
        self._lm = self._sae = self._ctx = None

    @property
    def lm(self):
        if self._lm is None:
            if self.scale.model == "gemma":
                self._lm, self._sae = load_gemma_preset(self.device)
            else:
                self._lm = load_model(self.scale.model, self.device, seed=self.scale.seed)
        return self._lm

    @property
    def sae(self):
        if self._sae is None:
            if self.scale.model == "gemma":
                _ = self.lm
            else:
                self._sae = self.files.sae(self.lm.adapter.device)
        return self._sae

    @property
    def contexts(self):
        if self._ctx is None:
            self._ctx = self.files.contexts()
        return self._ctx

    def hook(self) -> str:
        return self.lm.default_hook


# ----------------------------------------------------------------------------------------------------- stages


def _stage_sae(s: _Session, progress: bool) -> None:
    d, sc = s.files, s.scale
    if not d.has_contexts():
        _say(progress, "corpus")
        make_contexts(s.lm, sc.docs_per_domain, sc.ctx_len, sc.seed, sc.extra.get("stories"),
                      sc.windows_per_doc).save(d.contexts_path)
    pretrained = sc.model == "gemma"
    if d.quality_path.exists() and (pretrained or d.sae_dir.exists()):
        return
    given = (s.sae, {"release": GEMMA_PRESET["sae_release"], "sae_id": GEMMA_PRESET["sae_id"]}) if pretrained else None
    sae, quality = fit_sae(s.lm, s.contexts, sc.sae, sc.seed, given=given, say=lambda m: _say(progress, m))
    save_sae_stage(d, sae, quality, weights=not pretrained)


def _stage_scan(s: _Session, progress: bool) -> None:
    sc = s.scale
    if s.files.has_scan(MODES):
        return
    res, stats = scan(s.lm, s.sae, s.contexts, sc.n_latents, QScanConfig(
        n_candidates=sc.candidates, n_examples=sc.examples, modes=MODES, kl_cutoff=sc.kl_cutoff), sc.seed,
        say=lambda m: _say(progress, m))
    save_scan(s.files, res, stats)


def load_scan(out: str | Path, mode: str) -> QScanResult:
    """The :class:`~ntpflow.llm.qscan.QScanResult` saved as ``out/q_<mode>.json``."""
    return LLMDir(out).scan_result(mode)


def _resid_norm(s: _Session, n: int = 16) -> float:
    """Mean residual norm at the SAE site over the first ``n`` contexts (BOS excluded)."""
    a = s.lm.adapter.activations(s.contexts.tokens[:n], s.hook())[:, 1:]
    return float(a.float().norm(dim=-1).mean())


def _stage_steering(s: _Session, progress: bool) -> None:
    out, st = s.out, s.scale.steer
    if (out / "steering.json").exists():
        return
    r = load_scan(out, "reconstruction")
    high, low = pick_extremes(r.latents, r.q, r.included, st["n_extreme"])
    qmap = dict(zip(r.latents, r.q))
    norm = _resid_norm(s)
    runs = []
    for alpha in st["alphas"]:
        _say(progress, f"steering {len(high)} high-Q and {len(low)} low-Q latents, alpha={alpha}")
        res = steer_latents(s.lm.adapter, s.lm.tokenizer, s.sae, s.hook(), high + low, list(st["prompts"]),
                            s.lm.bos_id, alpha, relative_to=norm, max_new_tokens=st["max_new_tokens"],
                            temperature=st["temperature"], n_samples=st["n_samples"], seed=s.scale.seed)
        res["alpha"] = alpha
        runs.append(res)
    write_json(out / "steering.json", {"high": high, "low": low, "q": {str(f): qmap[f] for f in high + low},
                                       "resid_norm": norm, "mode": "reconstruction", "runs": runs,
                                       "rule": "code_score: see ntpflow.llm.steering"})


def _stage_lens(s: _Session, progress: bool) -> None:
    out, ls = s.out, s.scale.lens
    if (out / "lens.json").exists():
        return
    ctx = s.contexts
    g = torch.Generator().manual_seed(s.scale.seed + 1)
    idx = torch.randperm(len(ctx), generator=g)[:ls["n_contexts"]]
    tokens = ctx.tokens[idx]
    _say(progress, f"look-ahead lens data from {tokens.shape[0]} contexts")
    X, H = lens_data(s.lm.adapter, tokens, s.hook())
    W_U, b_U = _unembedding(s.lm.adapter)
    lenses, metrics = fit_lenses(X, H, tokens, W_U, b_U, ks=ls["ks"], ridge=ls["ridge"], seed=s.scale.seed)
    d = X.shape[-1]
    ranks = sorted({max(1, d // q) for q in ls["rank_divisors"]})
    E = encoder_matrix(s.sae)
    corr = {}
    for mode in MODES:
        r = load_scan(out, mode)
        corr[mode] = lens_q_correlation(lenses, E, r.latents, r.q, r.included, ranks)
    write_json(out / "lens.json", {"metrics": metrics, "ranks": ranks, "primary_rank": max(1, d // 16),
                                   "d_model": d, "n_contexts": int(tokens.shape[0]), "site": s.hook(),
                                   "target": "final hidden state at t+k-1 (the model's own logits for t+k)",
                                   "correlation": corr})


def _stage_qvi(s: _Session, progress: bool) -> None:
    out, ty = s.out, s.scale.toy
    if (out / "q_vs_influence.json").exists():
        return
    cfg = TrainConfig(task="majority", seed=s.scale.seed, device="cpu", **ty["train"])
    _say(progress, f"toy run for Q vs influence ({cfg.steps} steps)")
    with kept_threads():
        torch.set_num_threads(1)  # the toy model's ops are tiny: extra threads only add synchronisation on busy cores
        run = train(cfg, out / "toy_run", progress=False)
        load_or_probe(run, "final", "cpu")
        attribute(run.dir, AttributionSpec(toy_sites(ty["layers"], ty["positions"]), list(ty["features"]),
                                           sgd_rows=False, readout=min(256, cfg.n_eval)), device="cpu", progress=False)
        res = q_vs_influence(run.dir, n_sequences=ty["n_sequences"], device="cpu")
    res["train"] = cfg.to_dict()
    res["eval"] = {k: v for k, v in run.final_record().items() if k != "step"}
    write_json(out / "q_vs_influence.json", res)


def _copy_reuse(reuse: Path, out: Path, progress: bool) -> list[str]:
    """Copy stage-1/2 outputs of an earlier pipeline run (explicit ``reuse``) into ``out`` where absent; returns
    the stages whose outputs were copied now (``"sae"``, and ``"scan"`` when the folder holds one)."""
    if not reuse.is_dir():
        raise FileNotFoundError(f"reuse folder {reuse} does not exist")
    src_dir = LLMDir(reuse)
    needed = [p.name for p in (*src_dir.contexts_files, src_dir.sae_dir, src_dir.quality_path)]
    missing = [n for n in needed if not (reuse / n).exists()]
    if missing:
        raise FileNotFoundError(f"reuse folder {reuse} lacks {', '.join(missing)}")
    scan_files = [p.name for p in (*(src_dir.q_path(m) for m in MODES), src_dir.stats_path)]
    names = needed + (scan_files if src_dir.has_scan(MODES) else [])
    copied = []
    for n in names:
        src, dst = reuse / n, out / n
        if dst.exists():
            continue
        copied.append(n)
        _say(progress, f"reusing {src}")
        tmp = dst.with_name(f".{dst.name}.tmp")
        if src.is_dir():
            if tmp.exists():
                shutil.rmtree(tmp)
            shutil.copytree(src, tmp)
        else:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    markers = (("sae", src_dir.quality_path.name), ("scan", src_dir.stats_path.name))
    return [stage for stage, marker in markers if marker in copied]


STAGES = ("sae", "scan", "steering", "lens", "q_vs_influence")


def run_llm(scale: str | LLMScale, out: str | Path, *, device: str = "auto", progress: bool = True,
            reuse: str | Path | None = None, stages: tuple[str, ...] = STAGES) -> Path:
    """Run (or resume) the LLM experiment at ``scale`` into ``out``; returns ``out``.

    Args:
        scale: ``"smoke"``, ``"small"``, ``"paper"`` or an :class:`LLMScale`.
        out: results folder.
        device: ``"auto"`` (CUDA if present), ``"cpu"`` or ``"cuda"``.
        progress: stage messages on stderr.
        reuse: an earlier ``ntpflow qscan train`` (and ``scan``) folder whose corpus/SAE/scan to copy (explicit
            only).
        stages: the stages to run (default all, in order).
    """
    if isinstance(scale, str):
        if scale not in SCALES:
            raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
        scale = SCALES[scale]
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; choose from {STAGES}")
    if scale.model == "gemma":
        _check_online()
    out = ensure_writable_dir(out)
    meta_path = out / "meta.json"
    meta = {"scale": scale.name, "settings": _jsonable(asdict(scale)), "reuse": str(reuse) if reuse else None,
            "reused_stages": []}
    if meta_path.exists():
        old = read_json(meta_path)
        if old.get("scale") != scale.name:
            raise ValueError(f"{out} holds an llm run of scale {old.get('scale')!r}, not {scale.name!r}; choose "
                             f"another --out")
        meta["reuse"] = old.get("reuse") or meta["reuse"]
        meta["reused_stages"] = old.get("reused_stages", [])
    if reuse:
        reused = set(meta["reused_stages"]) | set(_copy_reuse(Path(reuse), out, progress))
        meta["reused_stages"] = sorted(reused, key=STAGES.index)
    write_json(meta_path, meta)
    s = _Session(scale, out, str(resolve_device(device)))
    fns = {"sae": _stage_sae, "scan": _stage_scan, "steering": _stage_steering, "lens": _stage_lens,
           "q_vs_influence": _stage_qvi}
    timing = read_json(out / "timing.json") if (out / "timing.json").exists() else {}
    for name in STAGES:
        if name in stages:
            t0 = time.perf_counter()
            fns[name](s, progress)
            dt = time.perf_counter() - t0
            if dt > 1.0 or name not in timing:
                timing[name] = dt
                write_json(out / "timing.json", timing)
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
