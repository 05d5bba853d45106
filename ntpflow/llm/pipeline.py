"""The offline default end to end: SmolLM2-135M-Instruct, an SAE trained with sae-lens on its middle layer, the
stories/code/math corpus, and the Q scan in both ablation modes.

    python -m ntpflow.llm.pipeline train --out runs/llm   # corpus, activations, SAE, quality.json
    python -m ntpflow.llm.pipeline scan --out runs/llm    # q_<mode>.json, stats.json

Everything is seeded. Sizes are small by default so that a CPU run takes minutes; raise them with the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ntpflow.llm.adapters import load_smollm2
from ntpflow.llm.corpus import Contexts, build_corpus, hf_encoder, tokenize_corpus
from ntpflow.llm.qscan import QScanConfig, q_scan, q_statistics
from ntpflow.llm.sae import TrainSAEConfig, collect_activations, load_sae, sae_quality, save_sae, train_sae


def _corpus(lm, args):
    docs = build_corpus(args.docs, seed=args.seed, stories_path=args.stories)
    return tokenize_corpus(docs, hf_encoder(lm.tokenizer), args.ctx_len, lm.bos_id,
                           max_windows_per_doc=args.windows)


def train(args) -> dict:
    """Build the corpus, collect activations at the middle layer, train the SAE, save it with its quality."""
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    lm = load_smollm2()
    ctx = _corpus(lm, args)
    torch.save({"tokens": ctx.tokens, "domains": ctx.domains, "doc_index": ctx.doc_index},
               os.path.join(args.out, "contexts.pt"))
    n = len(ctx)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(n, generator=g)
    n_eval = max(1, n // 10)
    acts_tr = collect_activations(lm.adapter, ctx.tokens[perm[n_eval:]], lm.default_hook)
    acts_ev = collect_activations(lm.adapter, ctx.tokens[perm[:n_eval]], lm.default_hook)
    t1 = time.perf_counter()
    cfg = TrainSAEConfig(d_sae=args.d_sae, architecture=args.arch, k=args.k, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    sae, info = train_sae(acts_tr, cfg, log_every=max(1, args.steps // 5))
    t2 = time.perf_counter()
    save_sae(sae, os.path.join(args.out, "sae"))
    out = {"model": lm.name, "hook": lm.default_hook, "n_contexts": n, "ctx_len": args.ctx_len,
           "n_train_tokens": int(acts_tr.shape[0]), "n_eval_tokens": int(acts_ev.shape[0]),
           "train": sae_quality(sae, acts_tr).to_dict(), "eval": sae_quality(sae, acts_ev).to_dict(),
           "sae": info, "seconds": {"activations": t1 - t0, "training": t2 - t1}}
    with open(os.path.join(args.out, "quality.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps({k: out[k] for k in ("train", "eval", "seconds")}, indent=1))
    return out


def scan(args) -> dict:
    """Q scan of the saved SAE in both modes; writes ``q_<mode>.json`` and ``stats.json``."""
    lm = load_smollm2()
    saved = torch.load(os.path.join(args.out, "contexts.pt"))
    ctx = Contexts(saved["tokens"], saved["domains"], saved["doc_index"])
    sae = load_sae(os.path.join(args.out, "sae"))
    n_lat = sae.W_dec.shape[0]
    g = torch.Generator().manual_seed(args.seed)
    latents = sorted(torch.randperm(n_lat, generator=g)[:args.latents].tolist())
    cfg = QScanConfig(n_candidates=args.candidates, n_examples=args.examples)
    t0 = time.perf_counter()
    res = q_scan(lm.adapter, sae, ctx, lm.default_hook, latents, cfg)
    secs = time.perf_counter() - t0
    stats = {"seconds": secs}
    for mode, r in res.items():
        with open(os.path.join(args.out, f"q_{mode}.json"), "w") as fh:
            json.dump(r.to_dict(), fh)
        stats[mode] = q_statistics(r)
    with open(os.path.join(args.out, "stats.json"), "w") as fh:
        json.dump(stats, fh, indent=1)
    print(json.dumps(stats, indent=1))
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ntpflow.llm.pipeline", description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["train", "scan"])
    ap.add_argument("--out", default="runs/llm")
    ap.add_argument("--stories", default=None,
                    help="a folder of TinyStories .txt files (default: generated stories)")
    ap.add_argument("--docs", type=int, default=100, help="documents per domain")
    ap.add_argument("--windows", type=int, default=2, help="windows per document")
    ap.add_argument("--ctx-len", type=int, default=64)
    ap.add_argument("--d-sae", type=int, default=2048)
    ap.add_argument("--arch", choices=["topk", "standard"], default="topk")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--latents", type=int, default=256, help="latents scored (a seeded random subset)")
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--examples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    (train if args.step == "train" else scan)(args)


if __name__ == "__main__":
    main()
