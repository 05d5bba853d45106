"""The stages of a Q(w) run of an LLM into one folder, shared by ``ntpflow qscan`` (train, scan or both) and
``ntpflow reproduce llm`` (which adds steering, lens and a toy check on top):

1. corpus (:func:`make_contexts`): stories, code and math documents cut into token windows
   (``contexts.safetensors`` + ``contexts.json``);
2. SAE (:func:`fit_sae`): activations at the model's default site on a seeded 90 % / 10 % split of the windows, an
   SAE trained on the 90 % (or a given one), its quality on both parts (``sae/``, ``quality.json``);
3. scan and statistics (:func:`scan`): Q(w) of a seeded random subset of latents in each ablation mode and the
   paper's statistics (``q_<mode>.json``, ``stats.json``).

:class:`LLMDir` names the folder's files. Every file is written atomically, in standard JSON (NaN as ``null``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ntpflow.files import InFolder, json_safe, read_json, sidecar, stamp, write_json
from ntpflow.llm.corpus import Contexts, build_corpus, hf_encoder, tokenize_corpus, user_documents
from ntpflow.llm.qscan import QScanConfig, QScanResult, q_scan, q_statistics
from ntpflow.llm.sae import (
    TrainSAEConfig,
    collect_activations,
    load_sae,
    sae_quality,
    save_sae,
    train_sae,
    train_simple_sae,
)

SAE_KINDS = ("simple", "topk", "standard")
"""Trained SAEs: ``simple`` (a TopK :class:`~ntpflow.llm.sae.SimpleSAE`, no sae-lens), ``topk`` or ``standard``
(sae-lens)."""


class LLMDir:
    """The files of an LLM Q(w) folder (as sae-lens's ``constants.py`` names its own)."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)

    contexts_path = InFolder("contexts.safetensors")  # the windows (Contexts.save); contexts_files: with its sidecar
    sae_dir = InFolder("sae")
    quality_path = InFolder("quality.json")
    stats_path = InFolder("stats.json")

    @property
    def contexts_files(self) -> tuple[Path, Path]:
        return self.contexts_path, sidecar(self.contexts_path)

    def q_path(self, mode: str) -> Path:
        """Q(w) of one ablation mode (:class:`~ntpflow.llm.qscan.QScanResult` as JSON)."""
        return self.dir / f"q_{mode}.json"

    def has_contexts(self) -> bool:
        return all(p.exists() for p in self.contexts_files)

    def has_scan(self, modes: tuple[str, ...]) -> bool:
        return self.stats_path.exists() and all(self.q_path(m).exists() for m in modes)

    def contexts(self) -> Contexts:
        return Contexts.load(self.contexts_path)

    def sae(self, device: str | torch.device = "cpu") -> Any:
        return load_sae(self.sae_dir, device)

    def scan_result(self, mode: str) -> QScanResult:
        """The saved scan of ``mode`` (``null`` read back as NaN)."""
        r = read_json(self.q_path(mode))
        nan = (lambda x: math.nan if x is None else x)
        r["q"], r["total_kl"] = [nan(x) for x in r["q"]], [nan(x) for x in r["total_kl"]]
        r["d_mean"] = [[nan(x) for x in row] for row in r["d_mean"]]
        return QScanResult(**r)


def _quiet(msg: str) -> None:
    pass


# ------------------------------------------------------------------------------------------------------ stages


def make_contexts(lm: Any, docs_per_domain: int, ctx_len: int, seed: int, stories: str | None = None,
                  windows_per_doc: int = 2, domains: dict[str, str] | None = None,
                  formal: tuple[str, ...] | None = None) -> Contexts:
    """Stage 1: the seeded corpus (``docs_per_domain`` documents of each domain; stories from the TinyStories
    folder ``stories`` or generated) cut into windows of ``ctx_len`` tokens of ``lm``'s tokenizer, BOS first.
    ``domains`` ({label: text file or folder}, :func:`~ntpflow.llm.corpus.user_documents`) replaces stories, code
    and math by the user's, with ``formal`` the labels that count as formal."""
    docs = (user_documents(domains, docs_per_domain, seed) if domains
            else build_corpus(docs_per_domain, seed=seed, stories_path=stories))
    return tokenize_corpus(docs, hf_encoder(lm.tokenizer), ctx_len, lm.bos_id, max_windows_per_doc=windows_per_doc,
                           formal=formal if domains else None)


def train_sae_of_kind(acts: torch.Tensor, spec: dict, seed: int, progress: bool = False) -> tuple[Any, dict]:
    """An SAE trained on ``acts`` ``[N, d_in]`` as ``spec`` says: ``{"kind": one of SAE_KINDS, "d_sae", "k",
    "steps", "batch_size", "lr"}``; returns ``(sae, info)``. ``progress``: a bar over the steps (stage lines
    without a terminal)."""
    kind = spec["kind"]
    if kind == "simple":
        return train_simple_sae(acts, spec["d_sae"], spec["k"], spec["steps"], spec["batch_size"], spec["lr"],
                                seed=seed, progress=progress)
    if kind in ("topk", "standard"):
        return train_sae(acts, TrainSAEConfig(d_sae=spec["d_sae"], architecture=kind, k=spec["k"],
                                              steps=spec["steps"], batch_size=spec["batch_size"], lr=spec["lr"],
                                              seed=seed), progress=progress)
    raise ValueError(f"SAE kind must be one of {SAE_KINDS}, got {kind!r}")


def fit_sae(lm: Any, ctx: Contexts, spec: dict | None, seed: int, given: tuple[Any, dict] | None = None,
            say: Callable[[str], None] = _quiet) -> tuple[Any, dict]:
    """Stage 2: activations at ``lm.default_hook`` of a seeded 90 % / 10 % split of ``ctx``'s windows (BOS
    excluded), an SAE trained on the 90 % as ``spec`` says (:func:`train_sae_of_kind`), or ``given`` ``(sae,
    info)``, and its quality on both parts.

    Returns:
        ``(sae on the model's device, quality)``; ``quality`` is ``quality.json``: ``model, hook, n_contexts,
        ctx_len, n_train_tokens, n_eval_tokens, train, eval`` (:class:`~ntpflow.llm.sae.SAEQuality`), ``sae``
        (info) and ``seconds`` (``activations``, ``training``).
    """
    n, hook, dev = len(ctx), lm.default_hook, lm.adapter.device
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_eval = max(1, n // 10)
    t0 = time.perf_counter()
    say(f"activations of {n} contexts at {hook}")
    acts_tr = collect_activations(lm.adapter, ctx.tokens[perm[n_eval:]], hook)  # [N_train, d] CPU
    acts_ev = collect_activations(lm.adapter, ctx.tokens[perm[:n_eval]], hook)
    t1 = time.perf_counter()
    if given is None:
        if spec is None:
            raise ValueError("fit_sae needs an SAE spec to train, or a given (sae, info)")
        say(f"training a {spec['kind']} SAE ({spec['d_sae']} latents, k={spec['k']}, {spec['steps']} steps)")
        sae, info = train_sae_of_kind(acts_tr, spec, seed, progress=say is not _quiet)
        sae = sae.to(dev)
    else:
        sae, info = given
    t2 = time.perf_counter()
    return sae, {"model": lm.name, "hook": hook, "n_contexts": n, "ctx_len": int(ctx.tokens.shape[1]),
                 "n_train_tokens": int(acts_tr.shape[0]), "n_eval_tokens": int(acts_ev.shape[0]),
                 "train": sae_quality(sae, acts_tr.to(dev)).to_dict(),
                 "eval": sae_quality(sae, acts_ev.to(dev)).to_dict(),
                 "sae": info, "seconds": {"activations": t1 - t0, "training": t2 - t1}}


def pick_latents(d_sae: int, n: int, seed: int) -> list[int]:
    """A seeded random subset of ``min(n, d_sae)`` latent ids, sorted."""
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(d_sae, generator=g)[:min(n, d_sae)].tolist())


def exclusions(r: QScanResult) -> str:
    """Why latents of a scan were excluded, e.g. ``"3 without a usable example, 2 with mean total KL ≤ 0.05"``
    (empty when none was)."""
    no_ex = sum(1 for n in r.n_examples if n == 0)
    low = sum(1 for n, ok in zip(r.n_examples, r.included) if n > 0 and not ok)
    parts = [f"{no_ex} without a usable example"] if no_ex else []
    parts += [f"{low} with mean total KL ≤ {r.kl_cutoff:g}"] if low else []
    return ", ".join(parts)


def scan(lm: Any, sae: Any, ctx: Contexts, n_latents: int, cfg: QScanConfig, seed: int,
         say: Callable[[str], None] = _quiet) -> tuple[dict[str, QScanResult], dict]:
    """Stage 3: Q(w) (:func:`~ntpflow.llm.qscan.q_scan`) of ``n_latents`` latents (:func:`pick_latents`) of ``sae``
    at ``lm.default_hook`` over ``ctx`` in each of ``cfg.modes``, and the statistics.

    Returns:
        ``({mode: QScanResult}, stats)``; ``stats`` is ``stats.json``: ``seconds`` and per mode
        :func:`~ntpflow.llm.qscan.q_statistics` with ``excluded_because`` (:func:`exclusions`) and ``hook`` (the
        site scanned, also said once in the stage line).
    """
    latents = pick_latents(int(sae.W_dec.shape[0]), n_latents, seed)
    hook = lm.default_hook
    say(f"Q scan of {len(latents)} latents at hook {hook} over {len(ctx)} contexts in {len(cfg.modes)} mode(s)")
    t0 = time.perf_counter()
    res = q_scan(lm.adapter, sae, ctx, hook, latents, cfg, progress=say is not _quiet)
    stats: dict = {"seconds": time.perf_counter() - t0}
    for mode, r in res.items():
        stats[mode] = {**q_statistics(r), "excluded_because": exclusions(r), "hook": hook}
    return res, stats


def save_scan(d: LLMDir, res: dict[str, QScanResult], stats: dict) -> None:
    """Write ``q_<mode>.json`` per mode and ``stats.json`` into ``d`` (standard JSON)."""
    for mode, r in res.items():
        write_json(d.q_path(mode), json_safe(r.to_dict()))
    write_json(d.stats_path, json_safe({**stats, "stamp": stamp()}))


def save_sae_stage(d: LLMDir, sae: Any, quality: dict, weights: bool = True) -> None:
    """Write ``sae/`` (unless ``weights`` is False: a pretrained SAE) and ``quality.json`` into ``d`` (quality
    last: it marks the stage done)."""
    if weights:
        save_sae(sae, d.sae_dir)
    write_json(d.quality_path, json_safe({**quality, "stamp": stamp()}))
