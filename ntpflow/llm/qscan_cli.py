"""``ntpflow qscan``: Q(w) of SAE latents of a language model, by ablation (PAPER.md §1.8).

    ntpflow qscan --model smollm2 --train-sae --latents 96 --out runs/qscan
    ntpflow qscan --model smollm2 --sae runs/llm/sae --latents 256 --out runs/qscan2 --mode reconstruction

Writes ``OUT/contexts.pt``, ``OUT/sae/`` (with ``--train-sae``), ``OUT/quality.json`` (with ``--train-sae``),
``OUT/q_<mode>.json`` and ``OUT/stats.json``. ``main(argv)`` returns the exit code; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ntpflow qscan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                    help="smollm2: SmolLM2-135M-Instruct offline; tiny: a random 2-layer GPT-2 over bytes (tests)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--sae", metavar="DIR", help="an SAE folder (sae-lens format or ntpflow SimpleSAE)")
    src.add_argument("--train-sae", action="store_true", help="train an SAE on the corpus first")
    ap.add_argument("--latents", type=int, default=96, help="latents scored (a seeded random subset)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--mode", default="reconstruction,error-preserving",
                    help="comma-separated ablation modes: reconstruction, error-preserving")
    ap.add_argument("--docs", type=int, default=100, help="documents per domain (stories, code, math)")
    ap.add_argument("--ctx-len", type=int, default=64)
    ap.add_argument("--d-sae", type=int, default=2048, help="latents of a trained SAE")
    ap.add_argument("--k", type=int, default=32, help="TopK sparsity of a trained SAE")
    ap.add_argument("--steps", type=int, default=1500, help="SAE training steps")
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--examples", type=int, default=6)
    ap.add_argument("--kl-cutoff", type=float, default=0.05)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def run(args: argparse.Namespace) -> dict:
    """The scan described by parsed ``args``; returns the statistics written to ``stats.json``."""
    import torch

    from ..io import ensure_writable_dir, write_json
    from .components import (
        load_model,
        load_sae_dir,
        resolve_device,
        save_sae_dir,
        train_simple_sae,
    )
    from .corpus import build_corpus, hf_encoder, tokenize_corpus
    from .qscan import MODES, QScanConfig, q_scan, q_statistics
    from .sae import TrainSAEConfig, collect_activations, sae_quality, train_sae

    modes = tuple(m for m in args.mode.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--mode must list modes from {MODES}, got {args.mode!r}")
    if args.latents < 1:
        raise ValueError(f"--latents must be positive, got {args.latents}")
    if args.sae and not Path(args.sae).is_dir():
        raise FileNotFoundError(f"SAE folder {args.sae} does not exist")
    out = ensure_writable_dir(args.out)
    lm = load_model(args.model, resolve_device(args.device), seed=args.seed)
    docs = build_corpus(args.docs, seed=args.seed, stories_path="/work/shared/data/tinystories")
    ctx = tokenize_corpus(docs, hf_encoder(lm.tokenizer), args.ctx_len, lm.bos_id)
    torch.save({"tokens": ctx.tokens, "domains": ctx.domains, "doc_index": ctx.doc_index}, out / "contexts.pt")
    hook = lm.default_hook
    if args.train_sae:
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
    res = q_scan(lm.adapter, sae, ctx, hook, latents,
                 QScanConfig(n_candidates=args.candidates, n_examples=args.examples, modes=modes,
                             kl_cutoff=args.kl_cutoff))
    stats = {}
    for mode, r in res.items():
        write_json(out / f"q_{mode}.json", r.to_dict())
        stats[mode] = q_statistics(r)
    write_json(out / "stats.json", stats)
    return stats


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the scan, print a one-line summary; returns the exit code (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        stats = run(args)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError) as e:
        print(f"ntpflow qscan: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    parts = [f"{m}: {s['n_included']}/{s['n_scored']} latents included" for m, s in stats.items()]
    print(f"{args.out}: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
