"""``ntpflow qscan``: Q(w) of SAE latents of a language model, by ablation (docs/paper.md#q).

    ntpflow qscan --model smollm2 --train-sae --latents 96 --out runs/qscan
    ntpflow qscan --model smollm2 --sae runs/llm/sae --latents 256 --out runs/qscan2 --mode reconstruction

Writes ``OUT/contexts.pt``, ``OUT/sae/`` (with ``--train-sae``), ``OUT/quality.json`` (with ``--train-sae``),
``OUT/q_<mode>.json`` and ``OUT/stats.json``. ``main(argv)`` returns the exit code; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ntpflow.files import ensure_writable_dir, json_safe, write_json
from ntpflow.llm.components import load_model, load_sae_dir, resolve_device, save_sae_dir, train_simple_sae
from ntpflow.llm.corpus import build_corpus, hf_encoder, tokenize_corpus
from ntpflow.llm.qscan import MODES, QScanConfig, q_scan, q_statistics
from ntpflow.llm.sae import TrainSAEConfig, collect_activations, sae_quality, train_sae

EPILOG = """examples:
  ntpflow qscan --model tiny --train-sae --latents 8 --docs 8 --steps 50 --out runs/qscan-tiny   # seconds, no download
  ntpflow qscan --model smollm2 --train-sae --latents 96 --out runs/qscan
  ntpflow qscan --model smollm2 --sae runs/qscan/sae --latents 256 --mode reconstruction --out runs/qscan2

Python equivalent:
  from ntpflow.llm.qscan_cli import main; main(["--model", "tiny", "--train-sae", "--out", "runs/qscan-tiny"])
  (the library calls: ntpflow.llm.qscan.q_scan(adapter, sae, contexts, hook, latents, QScanConfig(...)))

A latent is included in the statistics when it has at least one usable example (active in some context with
the scan's 10 future predictions after it) and its mean total KL over them exceeds --kl-cutoff; the summary line
says how many latents fail each condition."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ntpflow qscan", description=__doc__.split("\n")[0], epilog=EPILOG,
                                 formatter_class=_Formatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                    help="smollm2: SmolLM2-135M-Instruct offline; tiny: a random 2-layer GPT-2 over bytes (tests)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sae", metavar="DIR", help="an SAE folder (sae-lens format or ntpflow SimpleSAE)")
    src.add_argument("--train-sae", action="store_true", help="train an SAE on the corpus first")
    ap.add_argument("--latents", type=int, default=96, help="latents scored (a seeded random subset)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--mode", default="reconstruction,error-preserving",
                    help="comma-separated ablation modes: reconstruction (the reference's: the activation is "
                         "replaced by the SAE reconstruction without the latent), error-preserving (only the latent's "
                         "contribution is removed)")
    ap.add_argument("--docs", type=int, default=100, help="documents per domain (stories, code, math)")
    ap.add_argument("--stories", metavar="DIR", default=None,
                    help="a folder of TinyStories .txt files for the stories domain (default: generated stories)")
    ap.add_argument("--ctx-len", type=int, default=64, help="tokens per context window")
    ap.add_argument("--d-sae", type=int, default=2048, help="latents of a trained SAE")
    ap.add_argument("--k", type=int, default=32, help="TopK sparsity of a trained SAE")
    ap.add_argument("--steps", type=int, default=1500, help="SAE training steps")
    ap.add_argument("--candidates", type=int, default=16,
                    help="top-activating contexts kept per latent before de-duplication")
    ap.add_argument("--examples", type=int, default=6, help="examples per latent after de-duplication")
    ap.add_argument("--kl-cutoff", type=float, default=0.05,
                    help="latents whose mean total KL over the horizon is at or below this are excluded")
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--seed", type=int, default=0, help="seed of the corpus, the SAE and the latent subset")
    return ap


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help text (unless it names its default itself); the epilog's examples keep
    their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not any(action.default is x for x in (None, False, argparse.SUPPRESS)) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _say(msg: str) -> None:
    print(f"ntpflow qscan: {msg}", file=sys.stderr, flush=True)


def _exclusions(r, cutoff: float) -> str:
    """Why latents of a scan result were excluded, e.g. ``"3 without a usable example, 2 with mean total KL ≤
    0.05"``."""
    no_ex = sum(1 for n in r.n_examples if n == 0)
    low = sum(1 for n, ok in zip(r.n_examples, r.included) if n > 0 and not ok)
    parts = [f"{no_ex} without a usable example"] if no_ex else []
    parts += [f"{low} with mean total KL ≤ {cutoff:g} (--kl-cutoff)"] if low else []
    return ", ".join(parts)


def run(args: argparse.Namespace) -> dict:
    """The scan described by parsed ``args``; returns the statistics written to ``stats.json``."""
    import torch

    modes = tuple(m for m in args.mode.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--mode must list modes from {MODES}, got {args.mode!r}")
    for flag in ("latents", "docs", "d_sae", "k", "steps", "candidates", "examples"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.k > args.d_sae:
        raise ValueError(f"--k {args.k} exceeds --d-sae {args.d_sae}")
    if args.ctx_len < 12:  # BOS, a position to ablate, and the 10 predictions scored after it
        raise ValueError(f"--ctx-len must be at least 12, got {args.ctx_len}")
    if not 0 <= args.kl_cutoff < float("inf"):
        raise ValueError(f"--kl-cutoff must be finite and >= 0, got {args.kl_cutoff}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    resolve_device(args.device)  # an unknown or unavailable device fails before anything is written
    if args.sae and not Path(args.sae).is_dir():
        raise FileNotFoundError(f"SAE folder {args.sae} does not exist")
    out = ensure_writable_dir(args.out)
    _say(f"loading {args.model}")
    lm = load_model(args.model, resolve_device(args.device), seed=args.seed)
    docs = build_corpus(args.docs, seed=args.seed, stories_path=args.stories)
    ctx = tokenize_corpus(docs, hf_encoder(lm.tokenizer), args.ctx_len, lm.bos_id)
    torch.save({"tokens": ctx.tokens, "domains": ctx.domains, "doc_index": ctx.doc_index}, out / "contexts.pt")
    hook = lm.default_hook
    _say(f"corpus: {len(ctx.tokens)} windows of {args.ctx_len} tokens")
    if args.train_sae:
        _say(f"training an SAE ({args.d_sae} latents, TopK {args.k}, {args.steps} steps)")
        acts = collect_activations(lm.adapter, ctx.tokens, hook)
        if args.model == "tiny":
            sae, info = train_simple_sae(acts, args.d_sae, args.k, args.steps, seed=args.seed)
        else:
            sae, info = train_sae(acts, TrainSAEConfig(d_sae=args.d_sae, k=args.k, steps=args.steps, seed=args.seed))
        save_sae_dir(sae, out / "sae")
        write_json(out / "quality.json", {"model": lm.name, "hook": hook, "train": sae_quality(sae, acts).to_dict(),
                                          "sae": {k: v for k, v in info.items() if k != "final_losses"}})
    else:
        sae = load_sae_dir(args.sae, device=str(lm.adapter.device))
    d_sae = int(sae.W_dec.shape[0])
    g = torch.Generator().manual_seed(args.seed)
    latents = sorted(torch.randperm(d_sae, generator=g)[:min(args.latents, d_sae)].tolist())
    _say(f"scanning {len(latents)} latents in {len(modes)} mode(s)")
    res = q_scan(lm.adapter, sae, ctx, hook, latents,
                 QScanConfig(n_candidates=args.candidates, n_examples=args.examples, modes=modes,
                             kl_cutoff=args.kl_cutoff))
    stats = {}
    for mode, r in res.items():
        write_json(out / f"q_{mode}.json", json_safe(r.to_dict()))  # standard JSON: null, not NaN
        stats[mode] = q_statistics(r)
        stats[mode]["excluded_because"] = _exclusions(r, args.kl_cutoff)
    write_json(out / "stats.json", json_safe(stats))
    return stats


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the scan, print a one-line summary; returns the exit code (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        stats = run(args)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError) as e:
        print(f"ntpflow qscan: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    parts = [f"{m}: {s['n_included']}/{s['n_scored']} latents included"
             + (f" (excluded: {s['excluded_because']})" if s["excluded_because"] else "") for m, s in stats.items()]
    print(f"{args.out}: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
