"""Training-step benchmark (issue 2): ntpflow GPT variants vs transformers' GPT-2 on the paper's toy configuration.

One training step = ``zero_grad`` + forward + ``lm_loss`` + backward + ``Adam.step``. All variants are built in one
process and timed *interleaved*: each round runs one timed step of every variant (the order rotates every round),
after a warm-up, and the reported number is the per-variant median over rounds. Machine noise therefore hits all
variants alike and the ratios are more stable than the absolute times.

Variants:
    vanilla      ntpflow GPT, one position group, myopic "none"
    hf_eager     transformers.GPT2LMHeadModel, attn_implementation="eager", same weights, same loss (lm_loss)
    untied       ntpflow GPT, position_groups="untied" (one parameter copy per position, 21 groups)
    split        ntpflow GPT, position_groups=[0]*10 + [1]*11
    myopic_kv    ntpflow GPT, myopic "kv"
    myopic_resid ntpflow GPT, myopic "resid"
    ref_loop     context only: a naive "reference-style" untied model, 21 separate single-group ntpflow GPTs;
                 a Python loop over positions where model p computes position p from the keys/values that the
                 earlier positions' models produced (a KV cache that stays in the autograd graph), so it computes
                 the same function and the same gradients as ``untied``.

Usage:
    python benchmarks/bench_step.py [--repeats 40] [--warmup 5] [--batch 256] [--threads N] [--device auto]
                                    [--adam default|foreach|fused] [--variants vanilla,untied,...] [--no-check]

Exits 0 whatever the PASS/FAIL outcome; it only reports.
"""

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import ClassVar

import torch
import torch.nn.functional as F

from ntpflow.model.config import GPTConfig
from ntpflow.model.gpt import GPT
from ntpflow.model.loss import lm_loss

# The paper's toy configuration.
N_LAYER, D_MODEL, N_HEAD, N_CTX, VOCAB = 2, 128, 4, 21, 5
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8  # ntpflow.runs.config.TrainConfig defaults

ALL_VARIANTS = ("vanilla", "hf_eager", "untied", "split", "myopic_kv", "myopic_resid", "ref_loop")

# (name, numerator, denominator, kind, bound, counts): PASS iff numerator/denominator <kind> bound.
# The last field says whether the line counts towards RESULT (myopic "resid" is reported against the kv bound only).
TARGETS = (
    ("HF eager / vanilla", "hf_eager", "vanilla", ">=", 1.3, True),
    ("untied / vanilla", "untied", "vanilla", "<=", 1.5, True),
    ("myopic kv / vanilla", "myopic_kv", "vanilla", "<=", 1.3, True),
    ("myopic resid / vanilla", "myopic_resid", "vanilla", "<=", 1.3, False),
)
# Reported without a target.
INFO_RATIOS = (
    ("split / vanilla", "split", "vanilla"),
    ("ref_loop / untied", "ref_loop", "untied"),
    ("ref_loop / vanilla", "ref_loop", "vanilla"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=40, help="timed rounds; each round times one step of every variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per variant (default 5)")
    p.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--adam", choices=("default", "foreach", "fused"), default="fused",
                   help="Adam implementation (default fused, as ntpflow.runs.training uses on CPU and CUDA)")
    p.add_argument("--seed", type=int, default=0, help="model-init and data seed (default 0)")
    p.add_argument("--variants", default=",".join(ALL_VARIANTS),
                   help=f"comma-separated subset of {','.join(ALL_VARIANTS)}")
    p.add_argument("--no-check", action="store_true", help="skip the start-up equivalence checks")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.batch < 1:
        p.error("--repeats and --batch must be >= 1, --warmup >= 0")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(ALL_VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}")
    return args


def cfg(**kw) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, n_ctx=N_CTX, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, **kw)


# ---------------------------------------------------------------------------------------------------- variants
class Variant:
    """A model, its Adam optimiser and a ``logits(tokens)`` function; ``step`` is one full training step."""

    adam_kwargs: ClassVar[dict] = {}  # set from --adam in main()

    def __init__(self, name: str, modules: list[torch.nn.Module], logits_fn, device):
        self.name, self.modules, self.logits_fn = name, modules, logits_fn
        for m in modules:
            m.to(device).train()
        self.params = [p for m in modules for p in m.parameters()]
        # --adam default: same optimiser as ntpflow.runs.training.train (torch picks its implementation for the device).
        self.opt = torch.optim.Adam(self.params, lr=LR, betas=BETAS, eps=EPS, **self.adam_kwargs)

    def loss(self, tokens, mask):
        return lm_loss(self.logits_fn(tokens), tokens, mask)

    def step(self, tokens, mask):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(tokens, mask)
        loss.backward()
        self.opt.step()
        return loss

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.params)


def make_ntpflow(name, seed, device, **kw) -> Variant:
    model = GPT(cfg(**kw), seed=seed)  # init from its own torch.Generator
    return Variant(name, [model], model, device)


def make_hf(seed, device) -> Variant:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=N_CTX, n_embd=D_MODEL, n_layer=N_LAYER, n_head=N_HEAD,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, use_cache=False,
        attn_implementation="eager",
    )
    # HF initialises from the global RNG: isolate it and seed it explicitly (the weights are overwritten below).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = GPT2LMHeadModel(hf_cfg)
    # Start from exactly the vanilla ntpflow weights (same init => same loss; checked at start-up).
    src = GPT(cfg(), seed=seed).to_hf()
    missing, unexpected = hf.load_state_dict(src.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    assert hf.config._attn_implementation == "eager", hf.config._attn_implementation

    def logits(tokens):
        return hf(input_ids=tokens, use_cache=False).logits

    return Variant("hf_eager", [hf], logits, device)


def make_ref_loop(seed, device) -> Variant:
    """21 single-group GPTs; model p computes position p, attending to the cached keys/values of positions < p.

    Uses each model's own submodules (LayerNorms, GroupedLinears with ``groups=None``), so the arithmetic per
    position is ntpflow's; only the attention over the (growing) KV cache is written out here.
    """
    models = torch.nn.ModuleList(GPT(cfg(), seed=seed) for _ in range(N_CTX))  # identical init, like untied
    n_head, d_head = N_HEAD, D_MODEL // N_HEAD

    def logits(tokens):
        b, t = tokens.shape
        keys = [[] for _ in range(N_LAYER)]
        values = [[] for _ in range(N_LAYER)]
        out = []
        for p in range(t):
            m = models[p]
            resid = F.embedding(tokens[:, p : p + 1], m.wte[0]) + m.wpe[0, p]  # [b, 1, d]
            for layer, blk in enumerate(m.blocks):
                x = blk.ln1(resid, None)
                q, k, v = (z.reshape(b, 1, n_head, d_head).transpose(1, 2)
                           for z in blk.attn.c_attn(x, None).chunk(3, dim=-1))  # [b, head, 1, d_head]
                keys[layer].append(k)
                values[layer].append(v)
                kk, vv = torch.cat(keys[layer], dim=2), torch.cat(values[layer], dim=2)  # [b, head, p+1, d_head]
                z = F.scaled_dot_product_attention(q, kk, vv)  # one query over positions 0..p: no mask needed
                resid = resid + blk.attn.c_proj(z.transpose(1, 2).reshape(b, 1, D_MODEL), None)
                resid = resid + blk.mlp(blk.ln2(resid, None), None)
            out.append(m.ln_final(resid, None) @ m.wte[0].T)  # [b, 1, vocab]
        return torch.cat(out, dim=1)

    return Variant("ref_loop", [models], logits, device)


def build(name, seed, device) -> Variant:
    if name == "vanilla":
        return make_ntpflow(name, seed, device)
    if name == "hf_eager":
        return make_hf(seed, device)
    if name == "untied":
        return make_ntpflow(name, seed, device, position_groups="untied")
    if name == "split":
        return make_ntpflow(name, seed, device, position_groups=[0] * 10 + [1] * 11)
    if name == "myopic_kv":
        return make_ntpflow(name, seed, device, myopic="kv")
    if name == "myopic_resid":
        return make_ntpflow(name, seed, device, myopic="resid")
    if name == "ref_loop":
        return make_ref_loop(seed, device)
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------------- checks
def check_equivalence(variants: dict[str, Variant], tokens, mask):
    """All variants start from the same weights and compute the same forward values: compare initial losses.

    ref_loop must also give untied's gradients (position p's model <-> untied group p).
    """
    losses = {}
    for name, v in variants.items():
        with torch.no_grad():
            losses[name] = v.loss(tokens, mask).item()
    ref = losses.get("vanilla", next(iter(losses.values())))
    bad = {n: l for n, l in losses.items() if not math.isclose(l, ref, rel_tol=1e-4, abs_tol=1e-5)}
    print(f"start-up check: initial loss {ref:.6f} in all variants" if not bad else
          f"start-up check: WARNING initial losses differ: {losses}")
    if "ref_loop" in variants and "untied" in variants:
        ref_v, unt = variants["ref_loop"], variants["untied"]
        for v in (ref_v, unt):
            v.opt.zero_grad(set_to_none=True)
            v.loss(tokens, mask).backward()
        models = ref_v.modules[0]
        gp = dict(unt.modules[0].named_parameters())
        worst = 0.0
        for name, p_untied in gp.items():
            g_ref = torch.stack([dict(models[p].named_parameters())[name].grad[0] for p in range(N_CTX)])
            g_unt = p_untied.grad
            if name == "wpe":  # untied wpe[g] [n_ctx, d]; model p only uses row p of its own wpe
                g_unt = torch.stack([g_unt[p, p] for p in range(N_CTX)])
                g_ref = torch.stack([dict(models[p].named_parameters())["wpe"].grad[0, p] for p in range(N_CTX)])
            scale = g_unt.abs().max().clamp(min=1e-12)
            worst = max(worst, ((g_ref - g_unt).abs().max() / scale).item())
        for v in (ref_v, unt):
            v.opt.zero_grad(set_to_none=True)
        status = "OK" if worst < 1e-3 else "WARNING mismatch"
        print(f"start-up check: ref_loop gradients vs untied, max relative difference {worst:.1e} ({status})")


# ---------------------------------------------------------------------------------------------------- timing
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("--device cuda requested but CUDA is not available", file=sys.stderr)
            return 2
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    import transformers

    print(f"ntpflow training-step benchmark  {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
          f"device {device} ({dev_name}), torch threads {torch.get_num_threads()}")
    print(f"config: n_layer {N_LAYER}, d_model {D_MODEL}, n_head {N_HEAD}, T {N_CTX}, vocab {VOCAB}, "
          f"batch {args.batch}; Adam ({args.adam}) lr {LR}; warm-up {args.warmup}, rounds {args.repeats}, seed {args.seed}")

    load0 = tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, VOCAB, (args.batch, N_CTX), generator=gen).to(device)
    mask = torch.ones(args.batch, N_CTX, dtype=torch.bool).to(device)  # training passes a loss mask too

    Variant.adam_kwargs = {} if args.adam == "default" else {args.adam: True}
    variants = {name: build(name, args.seed, device) for name in args.variants}
    if not args.no_check:
        check_equivalence(variants, tokens, mask)

    for v in variants.values():  # warm-up (allocator, kernels, Adam state creation)
        for _ in range(args.warmup):
            v.step(tokens, mask)
    sync()

    names = list(variants)
    times = {n: [] for n in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(args.repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:  # rotate the order so no variant always runs first/after another
                v = variants[name]
                sync()
                t0 = time.perf_counter()
                v.step(tokens, mask)
                sync()
                times[name].append(time.perf_counter() - t0)
            if r % 10 == 9:
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()

    med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    mins = {n: min(ts) * 1e3 for n, ts in times.items()}

    def paired(num, den):  # median over rounds of the within-round ratio (both steps ran back to back)
        return statistics.median(a / b for a, b in zip(times[num], times[den]))

    print()
    print(f"{'variant':<14}{'params':>11}{'median ms':>11}{'min ms':>9}{'p90 ms':>9}{'/ vanilla':>11}")
    for n in names:
        ts = sorted(t * 1e3 for t in times[n])
        p90 = ts[min(len(ts) - 1, round(0.9 * (len(ts) - 1)))]
        rel = f"{med[n] / med['vanilla']:.2f}x" if "vanilla" in med else "-"
        print(f"{n:<14}{variants[n].n_params:>11,}{med[n]:>11.2f}{ts[0]:>9.2f}{p90:>9.2f}{rel:>11}")

    print()
    print("ratios: 'median' = ratio of median step times (what the targets use); for judging noise also")
    print("        'paired' = median of per-round ratios, 'min' = ratio of the fastest steps")
    print(f"  {'':<26} {'median':>6}  {'paired':>6}  {'min':>6}")
    n_fail = 0
    for label, num, den, kind, bound, counts in TARGETS:
        if num not in med or den not in med:
            print(f"  {label:<26} skipped (variant not run)")
            continue
        ratio = med[num] / med[den]
        ok = ratio >= bound if kind == ">=" else ratio <= bound
        n_fail += counts and not ok
        note = "" if counts else "  (reported only)"
        print(f"  {label:<26} {ratio:6.2f}  {paired(num, den):6.2f}  {mins[num] / mins[den]:6.2f}"
              f"   target {kind} {bound:<4} {'PASS' if ok else 'FAIL'}{note}")
    for label, num, den in INFO_RATIOS:
        if num in med and den in med:
            print(f"  {label:<26} {med[num] / med[den]:6.2f}  {paired(num, den):6.2f}  {mins[num] / mins[den]:6.2f}"
                  f"   (info, no target)")
    if hasattr(os, "getloadavg"):
        print(f"\nload average (1, 5, 15 min) at start {load0}, at end {tuple(round(x, 2) for x in os.getloadavg())}"
              f" on {os.cpu_count()} CPUs")
    print()
    print("RESULT: all targets PASS" if n_fail == 0 else f"RESULT: {n_fail} target(s) FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
