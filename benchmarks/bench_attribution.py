"""Attribution benchmark: cost of one tracked training step (ntpflow ``InfluenceTracker``) vs a plain step vs a
re-implementation of the reference algorithm (paper digest §4.1–4.2), on the paper's toy configuration.

Configuration: GPT with 2 layers, d_model 128, 4 heads, T = n_ctx = 21, vocab 5, batch 256, float32, random tokens
from a seeded generator, Adam lr 1e-3 (no weight decay). The "maj" tracking load of the reference: 36 sites
(layers 1–2 × positions 2–19), 3 features per site = 108 probes (random unit directions ``Probe(site, f"f{j}", w)``);
the final model θ* is another GPT with a different seed.

Variants (each owns a model and an Adam optimiser built from the same seed; all are timed in ONE process,
interleaved round-robin with the order rotating every round, after a warm-up; medians are reported):

    plain      ``ntpflow.runs.training.train_step`` (forward + lm_loss + backward + Adam.step)
    tracked    ``tracker.track(model, opt, tokens, mask)`` + ``tracker.optimizer_step(model, opt)`` (all rows: SGD and
               Adam variants), what ``ntpflow attribute`` does: the training step on track()'s own gradient, whose
               ops are train_step's (bit for bit), so no second forward and backward. The "track() only" rows time
               track() alone (track() only / plain + 1 is the cost with a separate train_step).
    tracked_cached  the same with θ*'s probe projections from a replay's per-example cache (``use_dataset``; the
               warm-up fills it, as a replay's first epoch does), so no θ* forward per step
    adam_only  the same as tracked with ``InfluenceTracker(..., sgd_rows=False)`` (Adam rows only; ``--no-adam-only`` skips it)
    adam_midpoint  (``--midpoint``) adam_only with ``midpoint=True``: ∇R read at each step's midpoint, what
               ``ntpflow reproduce`` replays by default; adam_midpoint / adam_only is the midpoint's cost
    reference  ``ReferenceTracker.track`` (below; our own code following the digest's description of the reference's
               ``probe_grads_adam``) + ``train_step``. Per step: 1 no-grad forward of θ*, 1 non-myopic forward with
               residuals, 1 logits forward; per probe 1 backward of its risk (the full-length ∇θR is stored); 1
               backward of the pooled loss → g; per site 1 stop-gradient forward and 3 backwards (pooled sg loss,
               own-position loss/(T−1), own-position sg loss/(T−1)) → direct, pre-cached, shared; per site the Adam
               bookkeeping (3 first moments, shared second moment) and SGD deltas, their L2 norms, and the dot
               products with the ∇θR of every probe at that site. It is slow, so it runs in the first
               ``--ref-repeats`` rounds only (default 1).

At start-up a small check (2 sites, 2 probes each) confirms that ntpflow's tracker and the reference
re-implementation give the same influence values from the same state; it doubles as warm-up of the reference code.

Extra sections:
    memory   peak RSS growth of one tracked step in a fresh subprocess per probe count (after setup and plain
             warm-up steps, ``ru_maxrss`` before vs after ``track``); ``--mem-reference`` adds the reference.
    othello  (``--othello``) the Othello ``small`` tracking load: 3 layers, d_model 64, 4 heads, T 61, batch 64 of
             real random games, Adam lr 3e-3; one site ⟨2, 30⟩ × the 16 central squares with per-type risks
             (whole batch + each present square type, both mismatches); tracked and plain steps interleaved.
    curve    tracked-step cost vs number of sites, 3 probes per site, each N timed ``--curve-repeats`` times right
             after 3 plain steps (the ratio uses those). The toy model has 3 residual layers × 21 positions = 63 sites,
             so N ≤ 63. ``--curve-order layer`` (default): the first N sites of layers 0..2 × positions 0..20 in
             layer-major order, so small N are all layer-0 sites (VJPs through the embedding only: cheap);
             ``spread``: N sites spread evenly over that list. Both: ``--curve-order layer,spread``.
    matrices (``--matrices``) a replay's exact step (readout 256, Adam rows) through the tracker and through the
             replay account (rows and influence matrices: what attribute runs), interleaved; target <= 1.10.
    flops    (``--flops``) the matmul FLOPs of one tracked step (all rows; Adam rows only) per plain step, from a
             dispatch counter (torch's FLOP formulas for mm, bmm, addmm, ...; ``baddbmm_`` counted by hand).
    profile  (``--profile``) one extra tracked step with an exclusive-time breakdown by phase (forwards,
             decomposition cotangent passes, per-site passes and their VJP backwards, Adam bookkeeping, dot products/rest) from
             wrapping ntpflow's functions in this process, torch.profiler top ops, cProfile top entries, and
             standalone timings of ``decompose`` alone and of the risk VJPs alone.

Usage:
    python benchmarks/bench_attribution.py [--repeats 3] [--ref-repeats 1] [--skip-reference]
        [--sites-curve 1,4,16,36,63 | --no-curve] [--curve-order layer,spread] [--curve-repeats 1]
        [--no-memory] [--mem-reference] [--flops] [--profile] [--othello] [--no-adam-only] [--midpoint] [--matrices]
        [--threads N]
        [--device auto|cpu|cuda] [--markdown PATH] [--smoke]

On a shared, busy machine use ``--threads 1``: with 2 threads on 2 busy cores, small ops (the plain step) slow down
far more than big ones and the ratios become meaningless. ``--device`` (default auto: CUDA when available) puts every
variant on that device; the clock waits for queued CUDA work before each reading, and the memory section (host RSS)
is skipped off the CPU. Exits 0 whatever the PASS/FAIL outcome; it only reports.
"""

import argparse
import copy
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from ntpflow.engine import decomposition as attribution
from ntpflow.engine import forward_mode, influence
from ntpflow.engine.influence import InfluenceTracker, Probe
from ntpflow.engine.replay_account import ReplayAccount
from ntpflow.files import resolve_device
from ntpflow.model.config import GPTConfig
from ntpflow.model.gpt import GPT
from ntpflow.model.loss import per_position_loss
from ntpflow.model.sites import Site
from ntpflow.replay.from_account import account_rows
from ntpflow.runs.training import train_step

# The paper's toy configuration.
N_LAYER, D_MODEL, N_HEAD, N_CTX, VOCAB, BATCH = 2, 128, 4, 21, 5, 256
LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
TARGET = 16.0  # tracked / plain, all rows (issue 14)
ADAM_TARGET = 12.0  # tracked / plain, Adam rows only
OTHELLO_TARGET = 3.0  # Othello site ⟨2, 30⟩, tracked / plain

MAIN_SITES = [Site(k, p) for k in (1, 2) for p in range(2, 20)]  # the reference's 36 "maj" sites
CURVE_SITES = [Site(k, p) for k in range(N_LAYER + 1) for p in range(N_CTX)]  # 63 sites, layer-major
CURVE_ORDERS = {
    "layer": "the first N sites of layers 0..2 x positions 0..20 in layer-major order (0:0, 0:1, ..., 2:20)",
    "spread": "N sites spread evenly over that layer-major list (index floor((j + 0.5) * 63 / N), j < N)",
}


def curve_sites(n: int, order: str) -> list[Site]:
    if order == "layer":
        return CURVE_SITES[:n]
    return [CURVE_SITES[int((j + 0.5) * len(CURVE_SITES) / n)] for j in range(n)]
COMPONENTS = ("direct", "pre_cached", "shared", "full")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of plain and tracked (default 3)")
    p.add_argument("--ref-repeats", type=int, default=1, help="rounds in which the reference also runs (default 1)")
    p.add_argument("--skip-reference", action="store_true", help="do not time the reference re-implementation")
    p.add_argument("--warmup", type=int, default=1, help="untimed tracked warm-up steps (default 1; plain gets 3)")
    p.add_argument("--plain-per-round", type=int, default=5, help="timed plain steps per round (default 5)")
    p.add_argument("--probes-per-site", type=int, default=3, help="features per site (default 3 -> 108 probes)")
    p.add_argument("--sites-curve", default="1,4,16,36,63", help="site counts for the curve (max 63)")
    p.add_argument("--no-curve", action="store_true", help="skip the sites curve")
    p.add_argument("--curve-order", default="layer",
                   help="comma-separated site orders for the curve: " + "; ".join(f"{k}: {v}" for k, v in CURVE_ORDERS.items()))
    p.add_argument("--curve-repeats", type=int, default=1, help="timed tracked steps per curve point (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    p.add_argument("--mem-probes", default="3,36,108",
                   help="probe counts for the memory section (default 3,36,108; see the report for the site sets)")
    p.add_argument("--mem-reference", action="store_true", help="also measure the reference's memory (108 probes)")
    p.add_argument("--profile", action="store_true", help="profile one extra tracked step")
    p.add_argument("--flops", action="store_true",
                   help="count the matmul FLOPs of one tracked step (all rows, Adam rows only) against a plain step")
    p.add_argument("--othello", action="store_true", help="also time the Othello small tracking load")
    p.add_argument("--no-adam-only", action="store_true", help="do not time the Adam-rows-only variant")
    p.add_argument("--midpoint", action="store_true", help="also time adam_only with the influence read at each "
                   "step's midpoint (needs the Adam-rows-only variant)")
    p.add_argument("--matrices", action="store_true", help="also time a replay's exact step (readout 256) through the "
                   "tracker and through the replay account (rows and matrices), side by side (Adam rows only)")
    p.add_argument("--no-check", action="store_true", help="skip the start-up agreement check")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="model seed (θ* uses seed+1000, data seed+1, probes seed+2)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda; the memory section "
                   "(host RSS) runs on the CPU only")
    p.add_argument("--markdown", default=None, help="also write the report as markdown to this path")
    p.add_argument("--smoke", action="store_true", help="tiny load (4 sites) to test this script quickly")
    p.add_argument("--bucket-width", type=int, default=None,
                   help="InfluenceTracker bucket_width (default: the tracker's, 1 on a CPU, 4 on a GPU)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.repeats, args.plain_per_round, args.probes_per_site, args.curve_repeats) < 1:
        p.error("--repeats, --plain-per-round, --probes-per-site and --curve-repeats must be >= 1")
    args.curve = [int(x) for x in args.sites_curve.split(",") if x.strip()]
    if any(not 1 <= n <= len(CURVE_SITES) for n in args.curve):
        p.error(f"--sites-curve values must be in 1..{len(CURVE_SITES)} (the toy model has "
                f"{N_LAYER + 1} residual layers x {N_CTX} positions)")
    args.curve_order = [x.strip() for x in args.curve_order.split(",") if x.strip()]
    if not args.curve_order or set(args.curve_order) - set(CURVE_ORDERS):
        p.error(f"--curve-order must be a comma-separated subset of {', '.join(CURVE_ORDERS)}")
    args.mem_probes = [int(x) for x in args.mem_probes.split(",") if x.strip()]
    if args.smoke:
        MAIN_SITES[:] = MAIN_SITES[:4]
    args.device = resolve_device(args.device)
    if args.device.type != "cpu":
        args.no_memory = True  # host RSS says nothing about device memory
    return args


# ------------------------------------------------------------------------------------------------------ setup
def gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, n_ctx=N_CTX, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL)


def make_model(seed: int, device: str | torch.device = "cpu") -> tuple[GPT, torch.optim.Adam]:
    model = GPT(gpt_config(), seed=seed).to(device).train()
    return model, torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS)


def make_batch(seed: int, device: str | torch.device = "cpu"):
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, N_CTX), generator=gen)
    return tokens.to(device), torch.ones(BATCH, N_CTX, dtype=torch.bool, device=device)


def make_probes(sites, per_site: int, seed: int, device: str | torch.device = "cpu") -> list[Probe]:
    gen = torch.Generator().manual_seed(seed + 2)
    probes = []
    for s in sites:
        for j in range(per_site):
            w = torch.randn(D_MODEL, generator=gen)
            probes.append(Probe(s, f"f{j}", (w / w.norm()).to(device)))
    return probes


def probe_load(n_probes: int) -> tuple[list[Site], int]:
    """(sites, probes per site) of a memory-section load with ``n_probes`` probes.

    The tracker tracks exactly the sites its probes sit on, so "36 sites with 3 probes" cannot exist: 3 probes are
    3 sites (the first 3 of the 36, one probe each), 36 probes are 1 per site on all 36, 108 are 3 per site.
    """
    if n_probes <= len(MAIN_SITES):
        return MAIN_SITES[:n_probes], 1
    if n_probes % len(MAIN_SITES):
        raise ValueError(f"probe count {n_probes} > {len(MAIN_SITES)} must be a multiple of {len(MAIN_SITES)}")
    return MAIN_SITES, n_probes // len(MAIN_SITES)


# ------------------------------------------------------------------------------------ reference re-implementation
def flatten(grads, params) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


class ReferenceTracker:
    """Our re-implementation of the reference's per-step tracking (digest §4.1 step 6 and §1.7), same conventions
    as ntpflow's tracker: R = batch mean of (⟨w, r(θ)⟩ − ⟨w, r(θ*)⟩)², value = ∇θR · Δ_c with Δ_c the subtracted
    step. One pass per quantity, as the reference does it; nothing batched."""

    def __init__(self, final_model: GPT, probes: list[Probe]):
        self.final_model = final_model.eval()
        self.probes = list(probes)
        self.sites = sorted({p.site for p in self.probes})
        self.moments: dict[tuple[Site, str], torch.Tensor] = {}
        self.step = 0

    def track(self, model: GPT, opt: torch.optim.Adam, tokens: torch.Tensor, loss_mask: torch.Tensor) -> list[dict]:
        group = opt.param_groups[0]
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        params = list(model.parameters())
        # fixed passes: θ* forward (no grad), non-myopic forward with residuals, logits forward
        with torch.no_grad():
            _, frozen = self.final_model(tokens, return_resid=True, myopic="none")
        _, hidden = model(tokens, return_resid=True, myopic="none")
        logits = model(tokens)
        # per probe: one backward of its risk; the full-length gradient vector is stored
        grad_r, risks = [], []
        for p in self.probes:
            k, i = p.site.layer, p.site.pos
            risk = F.mse_loss(hidden[k][:, i] @ p.w, frozen[k][:, i] @ p.w)
            risks.append(risk.item())
            grad_r.append(flatten(torch.autograd.grad(risk, params, retain_graph=True, allow_unused=True), params))
        # pooled loss -> g
        normal_loss, counted = per_position_loss(logits, tokens, loss_mask)
        n_pos = counted.sum().clamp(min=1)
        g = flatten(torch.autograd.grad(normal_loss.sum() / n_pos, params, retain_graph=True), params)
        # Adam: shared second moment from the optimizer's state, updated with the tracked full gradient
        states = [opt.state.get(p, {}) for p in params]
        t = int(states[0]["step"]) + 1 if states[0] else 1
        v_prev = flatten([s.get("exp_avg_sq") for s in states], params)
        v = beta2 * v_prev + (1 - beta2) * g * g
        scale = lr / (1 - beta1**t) / ((v / (1 - beta2**t)).sqrt() + eps)
        rows = [{"step": self.step, "layer": p.site.layer, "pos": p.site.pos, "feature": p.name,
                 "component": "risk", "optimizer": "none", "value": r} for p, r in zip(self.probes, risks)]
        norms = {}
        for s in self.sites:
            sg_logits = model(tokens, stop_grad_at=[s])
            sg_loss, _ = per_position_loss(sg_logits, tokens, loss_mask)
            g_sg = flatten(torch.autograd.grad(sg_loss.sum() / n_pos, params, retain_graph=True), params)
            if s.pos < len(normal_loss):
                g_i = flatten(torch.autograd.grad(normal_loss[s.pos] / n_pos, params, retain_graph=True,
                                                  allow_unused=True), params)
                g_i_sg = flatten(torch.autograd.grad(sg_loss[s.pos] / n_pos, params, allow_unused=True), params)
            else:  # the last position predicts nothing
                g_i = g_i_sg = torch.zeros_like(g)
            direct = g_i - g_i_sg
            comps = {"direct": direct, "pre_cached": g - g_sg - direct, "shared": g_sg}
            adam = {}
            for c, gc_ in comps.items():
                m = self.moments.get((s, c))
                m = (1 - beta1) * gc_ if m is None else beta1 * m + (1 - beta1) * gc_
                self.moments[s, c] = m
                adam[c] = scale * m
            adam["full"] = adam["direct"] + adam["pre_cached"] + adam["shared"]
            sgd = {c: lr * gc_ for c, gc_ in comps.items()}
            sgd["full"] = lr * g
            deltas = {"sgd": sgd, "adam": adam}
            for opt_name, per_c in deltas.items():
                for c, d in per_c.items():
                    norms[s, opt_name, c] = d.norm().item()
            for p, gr in zip(self.probes, grad_r):
                if p.site != s:
                    continue
                for opt_name, per_c in deltas.items():
                    for c in COMPONENTS:
                        rows.append({"step": self.step, "layer": s.layer, "pos": s.pos, "feature": p.name,
                                     "component": c, "optimizer": opt_name, "value": torch.dot(gr, per_c[c]).item()})
        self.step += 1
        return rows


def check_agreement(seed: int, tokens, mask) -> str:
    """ntpflow's tracker vs the reference re-implementation on 2 sites × 2 probes, from identical states."""
    sites = [Site(1, 3), Site(2, 7)]
    dev = tokens.device
    probes = make_probes(sites, 2, seed + 17, dev)
    final, _ = make_model(seed + 1000, dev)
    a, opt_a = make_model(seed, dev)
    b, opt_b = make_model(seed, dev)
    for m, o in ((a, opt_a), (b, opt_b)):
        train_step(m, o, tokens, mask)
    ours = InfluenceTracker(final, probes).track(a, opt_a, tokens, mask)
    ref = ReferenceTracker(copy.deepcopy(final), probes).track(b, opt_b, tokens, mask)

    def key(r):
        return r["layer"], r["pos"], r["feature"], r["component"], r["optimizer"]

    ours = {key(r): r["value"] for r in ours if r["feature_type"] == -1 and r["mismatch"] == "paper"}
    ref = {key(r): r["value"] for r in ref}
    if set(ours) != set(ref):
        return f"WARNING row sets differ ({len(ours)} vs {len(ref)} rows)"
    scale = max(abs(v) for v in ref.values()) or 1.0
    worst = max(abs(ours[k] - ref[k]) for k in ref) / scale
    return f"{len(ref)} values, max |difference| / max |value| = {worst:.1e} ({'OK' if worst < 1e-3 else 'WARNING'})"


# ------------------------------------------------------------------------------------------------------ timing
def now() -> float:
    """``time.perf_counter()`` after waiting for queued CUDA work (a no-op on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class Timer:
    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def run(self, name, fn):
        t0 = now()
        out = fn()
        self.times.setdefault(name, []).append(now() - t0)
        return out

    def median_ms(self, name) -> float:
        return statistics.median(self.times[name]) * 1e3


def main_table(args, tokens, mask, lines):
    plain_m, plain_o = make_model(args.seed, args.device)
    tr_m, tr_o = make_model(args.seed, args.device)
    probes = make_probes(MAIN_SITES, args.probes_per_site, args.seed, args.device)
    final = make_model(args.seed + 1000, args.device)[0]
    tracker = InfluenceTracker(final, probes, bucket_width=args.bucket_width)
    variants = {"plain": None, "tracked": None}
    # the same tracker with θ*'s projections from a replay's per-example cache (use_dataset; filled by the warm-up)
    ca_m, ca_o = make_model(args.seed, args.device)
    cached_tracker = InfluenceTracker(final, probes, bucket_width=args.bucket_width)
    cached_tracker.use_dataset(tokens)
    ids = torch.arange(len(tokens), device=tokens.device)
    variants["tracked_cached"] = None
    if not args.no_adam_only:
        ad_m, ad_o = make_model(args.seed, args.device)
        adam_tracker = InfluenceTracker(final, probes, sgd_rows=False, bucket_width=args.bucket_width)
        variants["adam_only"] = None
        if args.midpoint:
            mid_m, mid_o = make_model(args.seed, args.device)
            mid_tracker = InfluenceTracker(final, probes, sgd_rows=False, midpoint=True, bucket_width=args.bucket_width)
            variants["adam_midpoint"] = None
    if not args.skip_reference:
        ref_m, ref_o = make_model(args.seed, args.device)
        reference = ReferenceTracker(make_model(args.seed + 1000, args.device)[0], probes)
        variants["reference"] = None
    lines.append(f"load: {len(tracker.sites)} sites (layers 1-2 x positions 2-19), {len(probes)} probes "
                 f"({args.probes_per_site} per site), {sum(p.numel() for p in plain_m.parameters()):,} parameters")

    def tracked_step():
        t0 = now()
        tracker.track(tr_m, tr_o, tokens, mask)
        timer.times.setdefault("tracked: track() only", []).append(now() - t0)
        tracker.optimizer_step(tr_m, tr_o)

    def cached_step():
        cached_tracker.track(ca_m, ca_o, tokens, mask, example_ids=ids)
        cached_tracker.optimizer_step(ca_m, ca_o)

    def adam_only_step():
        t0 = now()
        adam_tracker.track(ad_m, ad_o, tokens, mask)
        timer.times.setdefault("adam_only: track() only", []).append(now() - t0)
        adam_tracker.optimizer_step(ad_m, ad_o)

    def midpoint_step():
        mid_tracker.track(mid_m, mid_o, tokens, mask)
        mid_tracker.optimizer_step(mid_m, mid_o)

    def reference_step():
        t0 = now()
        reference.track(ref_m, ref_o, tokens, mask)
        timer.times.setdefault("reference: tracking only", []).append(now() - t0)
        train_step(ref_m, ref_o, tokens, mask)

    # warm-up (allocator, Adam state); the reference code paths were warmed up by the agreement check
    pairs = [(plain_m, plain_o), (tr_m, tr_o), (ca_m, ca_o)] + ([(ref_m, ref_o)] if "reference" in variants else [])
    pairs += [(ad_m, ad_o)] if "adam_only" in variants else []
    pairs += [(mid_m, mid_o)] if "adam_midpoint" in variants else []
    for m, o in pairs:
        for _ in range(3):
            train_step(m, o, tokens, mask)
    for _ in range(args.warmup):
        for name, trk, m, o in [("tracked", tracker, tr_m, tr_o)] + (
                [("adam_only", adam_tracker, ad_m, ad_o)] if "adam_only" in variants else []) + (
                [("adam_midpoint", mid_tracker, mid_m, mid_o)] if "adam_midpoint" in variants else []):
            t0 = now()
            trk.track(m, o, tokens, mask)
            print(f"  warm-up {name} step: {now() - t0:.1f} s", flush=True)
            trk.optimizer_step(m, o)
        cached_tracker.track(ca_m, ca_o, tokens, mask, example_ids=ids)
        cached_tracker.optimizer_step(ca_m, ca_o)

    timer = Timer()
    names = list(variants)
    gc.collect()
    gc.disable()
    try:
        for r in range(args.repeats):
            active = [n for n in names if n != "reference" or r < args.ref_repeats]
            k = r % len(active)
            for name in active[k:] + active[:k]:
                t0 = now()
                if name == "plain":
                    for _ in range(args.plain_per_round):
                        timer.run("plain", lambda: train_step(plain_m, plain_o, tokens, mask))
                elif name == "tracked":
                    timer.run("tracked", tracked_step)
                elif name == "tracked_cached":
                    timer.run("tracked_cached", cached_step)
                elif name == "adam_only":
                    timer.run("adam_only", adam_only_step)
                elif name == "adam_midpoint":
                    timer.run("adam_midpoint", midpoint_step)
                else:
                    timer.run("reference", reference_step)
                print(f"  round {r + 1}/{args.repeats}: {name} {now() - t0:.1f} s", flush=True)
                gc.collect()
    finally:
        gc.enable()
    return timer


# ---------------------------------------------------------------------------------------------------- memory
def proc_status_mb(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (peak RSS of this process image) from /proc/self/status, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child_memory(spec: str, args) -> None:
    """Subprocess entry: ``tracked:N`` or ``reference:N``; prints one JSON line."""
    kind, n = spec.split(":")
    tokens, mask = make_batch(args.seed, args.device)
    model, opt = make_model(args.seed, args.device)
    sites, per_site = probe_load(int(n))
    probes = make_probes(sites, per_site, args.seed, args.device)
    final = make_model(args.seed + 1000, args.device)[0]
    tracker = InfluenceTracker(final, probes) if kind == "tracked" else ReferenceTracker(final, probes)
    for _ in range(3):
        train_step(model, opt, tokens, mask)
    gc.collect()
    # VmHWM is per process image (ru_maxrss would carry the parent's peak across fork+exec)
    plain_peak = proc_status_mb("VmHWM")
    was_reset = reset_peak_rss()
    base_rss = proc_status_mb("VmRSS")
    base_peak = proc_status_mb("VmHWM")
    t0 = now()
    tracker.track(model, opt, tokens, mask)
    dt = now() - t0
    peak = proc_status_mb("VmHWM")
    print(json.dumps({"kind": kind, "probes": len(probes), "sites": len(tracker.sites), "rss_before_mb": base_rss,
                      "plain_peak_mb": plain_peak, "peak_reset": was_reset, "peak_after_mb": peak,
                      "delta_mb": peak - (base_rss if was_reset else base_peak), "seconds": dt}))


def memory_section(args) -> list[dict]:
    specs = [f"tracked:{n}" for n in args.mem_probes]
    if args.mem_reference:
        specs.append(f"reference:{len(MAIN_SITES) * args.probes_per_site}")
    out = []
    for spec in specs:
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", spec, "--seed", str(args.seed)]
        if args.smoke:
            cmd.append("--smoke")
        if args.threads is not None:
            cmd += ["--threads", str(args.threads)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print(f"  memory child {spec} failed:\n{res.stderr[-2000:]}", flush=True)
            continue
        rec = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"  memory {spec}: peak +{rec['delta_mb']:.0f} MB ({rec['seconds']:.1f} s)", flush=True)
        out.append(rec)
    return out


# ----------------------------------------------------------------------------------------------------- curve
def curve_section(args, tokens, mask, order: str) -> list[dict]:
    model, opt = make_model(args.seed, args.device)
    final = make_model(args.seed + 1000, args.device)[0]
    for _ in range(3):
        train_step(model, opt, tokens, mask)
    out = []
    plain_all = []
    for n in args.curve:
        sites = curve_sites(n, order)
        tracker = InfluenceTracker(final, make_probes(sites, 3, args.seed, args.device), bucket_width=args.bucket_width)
        plain, tracked = [], []
        gc.collect()
        gc.disable()
        try:
            for _ in range(args.curve_repeats):
                for _ in range(3):
                    t0 = now()
                    train_step(model, opt, tokens, mask)
                    plain.append(now() - t0)
                t0 = now()
                tracker.track(model, opt, tokens, mask)
                tracker.optimizer_step(model, opt)
                tracked.append(now() - t0)
                gc.collect()
        finally:
            gc.enable()
        plain_all += plain
        n_dec = sum(1 if s.layer == N_LAYER else 2 for s in sites)  # pre-cached is structurally 0 at the last layer
        rec = {"sites": n, "probes": 3 * n, "layers": sorted({s.layer for s in sites}), "decomp_vjps": n_dec,
               "site_tangents": 2 * n_dec, "tracked_ms": statistics.median(tracked) * 1e3,
               "plain_ms_local": statistics.median(plain) * 1e3}
        print(f"  curve ({order}) {n} sites: {rec['tracked_ms'] / 1e3:.1f} s (plain {rec['plain_ms_local']:.0f} ms, "
              f"load average {os.getloadavg()[0]:.1f})", flush=True)
        out.append(rec)
    plain_med = statistics.median(plain_all) * 1e3
    for rec in out:
        rec["plain_ms"] = plain_med
        rec["ratio"] = rec["tracked_ms"] / rec["plain_ms_local"]  # plain steps timed right before each tracked one
    return out


# --------------------------------------------------------------------------------------------------- othello
def othello_section(args) -> list[str]:
    """The Othello ``small`` tracking load: site ⟨2, 30⟩ × 16 central squares, per-type risks, Adam."""
    import numpy as np

    from ntpflow.experiments.othello import CENTRAL_SQUARES
    from ntpflow.tasks.othello import SQUARE_NAMES, Othello

    task = Othello()
    cfg = GPTConfig(vocab_size=task.vocab_size, n_ctx=task.seq_len, n_layer=3, n_head=4, d_model=64)
    batch = task.sample(64, np.random.default_rng(args.seed))
    dev = args.device
    tokens = torch.as_tensor(batch.tokens).to(dev)
    mask = torch.as_tensor(batch.loss_mask).to(dev)
    site = Site(2, 30)
    gen = torch.Generator().manual_seed(args.seed + 3)
    probes, types = [], {}
    for name in CENTRAL_SQUARES:
        w = torch.randn(cfg.d_model, generator=gen)
        probes.append(Probe(site, name, (w / w.norm()).to(dev)))
        col = SQUARE_NAMES.index(name[3:])
        types[name] = torch.as_tensor(batch.feature_types[:, :, col].astype(np.int64)).to(dev)

    def model_opt(seed):
        m = GPT(cfg, seed=seed).to(dev).train()
        return m, torch.optim.Adam(m.parameters(), lr=3e-3)

    plain_m, plain_o = model_opt(args.seed)
    final = GPT(cfg, seed=args.seed + 1000).to(dev)
    # tracked: θ* forward every step; cached: θ*'s projections from the replay's per-example cache (use_dataset;
    # filled by the warm-up step here, as a replay fills it in its first epoch)
    runs = {name: (*model_opt(args.seed), InfluenceTracker(final, probes, bucket_width=args.bucket_width))
            for name in ("tracked", "cached")}
    runs["cached"][2].use_dataset(tokens)
    ids = {"tracked": None, "cached": torch.arange(len(tokens), device=dev)}
    for _ in range(3):
        train_step(plain_m, plain_o, tokens, mask)
    for name, (m, o, trk) in runs.items():
        for _ in range(3):
            train_step(m, o, tokens, mask)
        n_rows = len(trk.track(m, o, tokens, mask, types, example_ids=ids[name]))  # warm-up
        trk.optimizer_step(m, o)
    plain, tracked = [], {name: [] for name in runs}
    for _ in range(max(args.repeats, 3)):
        for _ in range(3):
            t0 = now()
            train_step(plain_m, plain_o, tokens, mask)
            plain.append(now() - t0)
        for name, (m, o, trk) in runs.items():
            t0 = now()
            trk.track(m, o, tokens, mask, types, example_ids=ids[name])
            trk.optimizer_step(m, o)
            tracked[name].append(now() - t0)
    p = statistics.median(plain) * 1e3
    out = [(f"Othello small load: 3 layers, d_model 64, T 61, batch 64, Adam; site {site} x {len(probes)} central "
            f"squares with per-type risks ({n_rows} rows per step); tracked step = track() + optimizer_step(); "
            f"{len(tracked['tracked'])} tracked steps of each variant and {len(plain)} plain steps interleaved"), "",
           "| variant | median ms | / plain | target |", "|---|---:|---:|---|", f"| plain | {p:.1f} | 1.0x | |"]
    for name, label in (("tracked", "tracked (θ* forward each step)"),
                        ("cached", "tracked, θ* projections cached (as in a replay)")):
        t = statistics.median(tracked[name]) * 1e3
        out.append(f"| {label} | {t:.1f} | {t / p:.1f}x | <= {OTHELLO_TARGET:.0f}x: "
                   f"{'PASS' if t / p <= OTHELLO_TARGET else 'FAIL'} |")
    return out


# ----------------------------------------------------------------------------------------------------- flops
class MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs of every matmul-like op dispatched inside it (torch's FLOP formulas; the in-place
    ``baddbmm_``, which has none, counted as 2·b·n·k·m)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet is torch.ops.aten.baddbmm_:
            b1, b2 = args[1], args[2]
            self.flops += 2 * b1.shape[0] * b1.shape[1] * b1.shape[2] * b2.shape[2]
        elif packet in flop_registry:
            shape = lambda x: x.shape if isinstance(x, torch.Tensor) else x  # noqa: E731
            self.flops += flop_registry[packet](*tree_map(shape, args), **tree_map(shape, kwargs),
                                                out_val=tree_map(shape, out))
        return out


def flops_section(args, tokens, mask) -> list[str]:
    """Matmul FLOPs of one tracked step (track() + optimizer_step(), after one warm-up step) per plain step."""
    probes = make_probes(MAIN_SITES, args.probes_per_site, args.seed, args.device)
    final = make_model(args.seed + 1000, args.device)[0]
    plain_m, plain_o = make_model(args.seed, args.device)
    train_step(plain_m, plain_o, tokens, mask)
    with MatmulFlops() as fc:
        train_step(plain_m, plain_o, tokens, mask)
    plain = fc.flops
    out = ["matmul FLOPs (dispatch counter: mm, bmm, addmm, baddbmm_ ...), one step after a warm-up step:",
           f"  plain step {plain / 1e9:.2f} GFLOP"]
    for label, sgd_rows, midpoint in (("all rows", True, False), ("Adam rows only", False, False),
                                      ("Adam rows only, read at the midpoint", False, True),
                                      ("Adam rows only, the exact account (readout = the batch, 2 points)", False,
                                       "exact")):
        m, o = make_model(args.seed, args.device)
        tracker = InfluenceTracker(final, probes, sgd_rows=sgd_rows, bucket_width=args.bucket_width,
                                   midpoint=midpoint is True)
        if midpoint == "exact":  # a readout set of the batch's size; no step refined (rtol 1: the FLOPs of a step
            tracker.use_readout(tokens, rtol=1.0, cap=1.0)  # integrated once; each refinement adds its points' share)
        tracker.track(m, o, tokens, mask)
        tracker.optimizer_step(m, o)
        with MatmulFlops() as fc:
            tracker.track(m, o, tokens, mask)
            tracker.optimizer_step(m, o)
        out.append(f"  tracked step, {label}: {fc.flops / 1e9:.2f} GFLOP = {fc.flops / plain:.2f} plain steps")
    return out


# --------------------------------------------------------------------------------------------------- profile
class PhaseStack:
    """Exclusive ("self") wall time per phase label: time goes to the innermost active phase."""

    def __init__(self):
        self.stack: list[str] = []
        self.acc: dict[str, float] = {}
        self.t = 0.0

    def push(self, label: str):
        t = now()
        if self.stack:
            self.acc[self.stack[-1]] = self.acc.get(self.stack[-1], 0.0) + t - self.t
        self.stack.append(label)
        self.t = t

    def pop(self):
        t = now()
        label = self.stack.pop()
        self.acc[label] = self.acc.get(label, 0.0) + t - self.t
        self.t = t

    def top(self) -> str:
        return self.stack[-1] if self.stack else ""

    def wrap(self, label, fn):
        def wrapper(*a, **kw):
            self.push(label(self.top()) if callable(label) else label)
            try:
                return fn(*a, **kw)
            finally:
                self.pop()
        return wrapper


def profile_section(args, tokens, mask) -> list[str]:
    """One tracked step (the main load) with a phase breakdown, torch.profiler ops and cProfile entries.

    The phases come from wrapping ntpflow's functions in this process only (whichever of them exist in the
    installed version): ``decompose``, ``resid_cotangents``, ``sites_vjp``/``site_vjp`` (separately for the
    decomposition and for the risk gradients), ``InfluenceTracker._adam_deltas`` and ``.risk_cotangents``, and
    forward hooks on both models. Times are exclusive (a forward inside a VJP helper counts as that helper's forward).
    """
    model, opt = make_model(args.seed, args.device)
    probes = make_probes(MAIN_SITES, args.probes_per_site, args.seed, args.device)
    final = make_model(args.seed + 1000, args.device)[0]
    tracker = InfluenceTracker(final, probes)
    for _ in range(3):
        train_step(model, opt, tokens, mask)

    ph = PhaseStack()

    def ctx(top: str) -> str:  # the phase family a nested helper belongs to
        return top.split(":")[0]

    def forward_label(top):
        return "forwards (θ*, θ) in track()" if top == "track" else f"{ctx(top)}: forwards"

    hooks = []
    for m in (model, final):
        hooks.append(m.register_forward_pre_hook(lambda *_: ph.push(forward_label(ph.top()))))
        hooks.append(m.register_forward_hook(lambda *_: ph.pop()))
    patches = []
    for obj, name, label in [
        (influence, "decompose", "decomposition"),
        (influence, "decompose_with_vjps", "decomposition + risk VJPs"),  # newer ntpflow: one shared VJP pass
        (influence, "sites_vjp", "risk VJPs"),
        (influence, "site_vjp", "risk VJPs: batched backward"),  # older ntpflow
        (attribution.SitePasses, "run", lambda top: "site passes (decomposition + risk VJPs)"
         if top == "track" else f"{ctx(top)}: site passes"),  # ntpflow >= shared site passes
        (attribution.SitePasses, "run_many", "decomposition: reverse mode, per bucket"),  # tracker v2
        (attribution, "own_cotangents", lambda top: f"{ctx(top)}: own-position cotangents"),
        (attribution, "Primals", "forward mode: cached ordinary forward (Primals)"),
        (attribution, "_cotangent_pass", lambda top: f"{ctx(top)}: ∂L/∂r and myopic ∂L_i/∂r_i passes"),
        (attribution, "vjp_rows", lambda top: f"{ctx(top)}: VJP backwards"),
        (attribution, "resid_cotangents", lambda top: f"{ctx(top)}: ∂L/∂r and myopic ∂L_i/∂r_i passes"),
        (attribution, "sites_vjp", lambda top: f"{ctx(top)}: site VJPs"),
        (attribution, "site_vjp", lambda top: f"{ctx(top)}: batched VJP backward"),
        (InfluenceTracker, "_adam_deltas", "Adam bookkeeping (_adam_deltas)"),
        (InfluenceTracker, "_adam_full", "Adam bookkeeping (_adam_full)"),
        (influence.AdamStep, "scale", "Adam bookkeeping (AdamStep.scale)") if hasattr(influence, "AdamStep") else (
            influence, "AdamStep", "Adam bookkeeping"),
        (InfluenceTracker, "risk_cotangents", "risk values and cotangents"),
        (InfluenceTracker, "risk_coefficients", "risk values and cotangents"),
        (influence, "Primals", "forward mode: cached ordinary forward (Primals)"),
        (influence, "all_tangents", "forward mode: tangents along the full gradient and Adam step (all sites)"),
        (influence, "site_tangents", "forward mode: per-site tangents"),
    ]:
        if hasattr(obj, name):
            patches.append((obj, name, getattr(obj, name)))
            setattr(obj, name, ph.wrap(label, getattr(obj, name)))
    prof_c = cProfile.Profile()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = now()
            prof_c.enable()
            ph.push("track")
            tracker.track(model, opt, tokens, mask)
            ph.pop()
            prof_c.disable()
            total = now() - t0
    finally:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        for h in hooks:
            h.remove()

    # standalone, unprofiled: the decomposition alone and the forward-mode tangents alone (same state)
    extra = ["", (f"standalone timings on the same state (no profiler; {len(tracker.sites)} sites, {len(probes)} probes; "
             f"a VJP is one (∂r^k_i/∂θ)ᵀu, a tangent one J·δ):"), "", "| call | VJPs or tangents | ms |",
             "|---|---:|---:|"]
    n_dec = sum(1 if st.layer == N_LAYER else 2 for st in tracker.sites)
    t0 = now()
    attribution.decompose(model, tokens, tracker.sites, mask)
    extra.append(f"| decompose() alone | {n_dec} | {(now() - t0) * 1e3:.0f} |")
    n_params = sum(p.numel() for p in model.parameters())
    t0 = now()
    primals = forward_mode.Primals(model, tokens)
    extra.append(f"| Primals (cached ordinary forward) | - | {(now() - t0) * 1e3:.0f} |")
    t0 = now()
    for st in tracker.sites:
        forward_mode.site_tangents(primals, st.layer, st.pos, torch.zeros(4, n_params, device=tokens.device))
    extra.append(f"| site_tangents() along 4 directions per site | {4 * len(tracker.sites)} | "
                 f"{(now() - t0) * 1e3:.0f} |")
    t0 = now()
    train_step(model, opt, tokens, mask)
    extra.append(f"| (plain train_step, for scale) | - | {(now() - t0) * 1e3:.0f} |")

    phases = dict(ph.acc)
    phases[f"track() itself: SGD deltas, {8 * len(probes)} dot products + .item(), rows"] = phases.pop("track", 0.0)
    for name in list(phases):  # self time of a wrapper with inner phases
        if name.endswith(("site VJPs", "site passes")) or name in ("decomposition", "decomposition + risk VJPs",
                                                                    "risk VJPs"):
            phases[f"{name}: cotangent assembly, stacking, other"] = phases.pop(name)
    out = [(f"profiled tracked step (track() only, {len(tracker.sites)} sites, {len(probes)} probes): "
           f"{total * 1e3:.0f} ms (the profilers add some overhead; load average {os.getloadavg()[0]:.2f})"), "",
           "| phase (exclusive time) | ms | share |", "|---|---:|---:|"]
    for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
        out.append(f"| {k} | {v * 1e3:.0f} | {100 * v / total:.1f}% |")
    groups = {
        "decomposition alone (all)": lambda k: ctx(k) == "decomposition",
        "decomposition + risk VJPs in shared passes (all)": lambda k: ctx(k) in ("decomposition + risk VJPs",
                                                                                  "site passes (decomposition + risk VJPs)"),
        "risk VJPs alone (all)": lambda k: ctx(k) == "risk VJPs",
        "Adam bookkeeping": lambda k: k.startswith("Adam"),
        "risk values and cotangents": lambda k: k.startswith("risk values"),
        "forwards in track() itself (θ*, θ)": lambda k: k.startswith("forwards"),
        "track() itself (SGD deltas, dots, rows)": lambda k: k.startswith("track()"),
        "all forwards": lambda k: "forwards" in k,
        "all VJP backwards": lambda k: "VJP backward" in k,
        "all ∂L/∂r and myopic cotangent passes (backwards only)": lambda k: "∂L/∂r" in k,
    }
    out += ["", "| grouped | ms | share |", "|---|---:|---:|"]
    for name, pred in groups.items():
        v = sum(t for k, t in phases.items() if pred(k))
        if v > 0:
            out.append(f"| {name} | {v * 1e3:.0f} | {100 * v / total:.1f}% |")
    out += extra
    out += ["", "torch.profiler, top ops by self CPU time:", "", "```",
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12).rstrip(), "```", "",
            "cProfile, top entries by cumulative time:", "", "```"]
    s = io.StringIO()
    pstats.Stats(prof_c, stream=s).sort_stats("cumulative").print_stats(16)
    text = [line.rstrip() for line in s.getvalue().splitlines() if line.strip()]
    start = next((n for n, line in enumerate(text) if line.lstrip().startswith("ncalls")), 0)
    out += text[start:] + ["```"]
    return out


# -------------------------------------------------------------------------------------------------- matrices
def matrices_section(args, tokens, mask) -> list[str]:
    """A replay's exact step of one run (Adam rows, readout of 256 random sequences, default adaptive rule) through
    the tracker (the probe rows only; the run-axis replay's path) and through the replay account (what ``attribute``
    now runs: the rows from the account's accumulators, which also give the influence matrices), interleaved, same
    load as the main table."""
    probes = make_probes(MAIN_SITES, args.probes_per_site, args.seed, args.device)
    final = make_model(args.seed + 1000, args.device)[0]
    held = make_batch(args.seed + 3, args.device)[0]
    tracker = InfluenceTracker(final, probes, sgd_rows=False, bucket_width=args.bucket_width)
    tracker.use_readout(held)
    with torch.no_grad():
        resid = final(held, return_resid=True, myopic="none")[1]
    r_star = {s: resid[s.layer][:, s.pos] for s in MAIN_SITES}
    model, opt = make_model(args.seed, args.device)
    rows = lambda first, t: account_rows([(first, t)], r_star, account.own, account.names, probes)  # noqa: E731
    account = ReplayAccount(model, opt, probes, held, r_star, sgd_rows=False, bucket_width=args.bucket_width,
                            on_chunk=rows)
    m, o = make_model(args.seed, args.device)
    steps = {"tracker": lambda: (tracker.track(m, o, tokens, mask), tracker.optimizer_step(m, o)),
             "replay account": lambda: account.train_step(tokens, mask)}
    timer = Timer()
    for r in range(args.warmup + args.repeats):
        for name in list(steps)[r % 2:] + list(steps)[:r % 2]:
            t0 = now()
            steps[name]()
            if r >= args.warmup:
                timer.times.setdefault(name, []).append(now() - t0)
            print(f"  matrices round {r + 1}: {name} {now() - t0:.1f} s", flush=True)
    med = {n: timer.median_ms(n) for n in steps}
    ratio = med["replay account"] / med["tracker"]
    return [f"a replay's exact step (readout 256, Gauss-Legendre 2/4/8 adaptive, Adam rows; {len(MAIN_SITES)} sites x "
            f"d {D_MODEL}) through the tracker (probe rows) and through the replay account (rows and influence "
            f"matrices), {args.repeats} timed steps each after {args.warmup} warm-up (both take the same steps and "
            f"refinements: {tracker.evaluations} and {account.evaluations} point evaluations)", "",
            "| variant | median ms | min ms |", "|---|---:|---:|"] + [
            f"| {n} | {med[n]:.0f} | {min(timer.times[n]) * 1e3:.0f} |" for n in steps] + [
            "", "| ratio | value | target |", "|---|---:|---|",
            f"| replay account / tracker | {ratio:.3f}x | <= 1.10x: {'PASS' if ratio <= 1.10 else 'FAIL'} |"]


# ------------------------------------------------------------------------------------------------------ main
def git_revision() -> str:
    """Commit of the ntpflow checkout, with a note if ntpflow/ has uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(attribution.__file__)))
    try:
        rev = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "ntpflow"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"commit {rev}" + (" (ntpflow/ has uncommitted changes)" if dirty else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args._child:
        child_memory(args._child, args)
        return 0
    started = now()
    tokens, mask = make_batch(args.seed, args.device)
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    head = [f"ntpflow attribution benchmark  {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
            f"command: {command}",
            f"ntpflow: {git_revision()}",
            (f"device {torch.cuda.get_device_name(args.device) if args.device.type == 'cuda' else 'cpu'}; "
             f"torch {torch.__version__}, python {platform.python_version()}, CPU ({platform.processor() or 'cpu'}, "
            f"{os.cpu_count()} cores), torch threads {torch.get_num_threads()}, load average at start "
            f"{os.getloadavg()[0]:.2f}"),
            (f"config: n_layer {N_LAYER}, d_model {D_MODEL}, n_head {N_HEAD}, T {N_CTX}, vocab {VOCAB}, batch {BATCH}, "
            f"float32; Adam lr {LR}; rounds {args.repeats} (reference {0 if args.skip_reference else args.ref_repeats}),"
            f" plain steps per round {args.plain_per_round}, tracked warm-up {args.warmup}, seed {args.seed}")]
    for line in head:
        print(line, flush=True)
    report = list(head)
    if not args.no_check:
        msg = "start-up check, ntpflow tracker vs reference re-implementation: " + check_agreement(args.seed, tokens, mask)
        print(msg, flush=True)
        report.append(msg)

    lines: list[str] = []
    timer = main_table(args, tokens, mask, lines)
    med = {n: timer.median_ms(n) for n in timer.times}
    plain = med["plain"]
    table = lines + ["", "| variant | timed steps | median ms | min ms | / plain |", "|---|---:|---:|---:|---:|"]
    for n in ("plain", "tracked", "tracked: track() only", "tracked_cached", "adam_only", "adam_only: track() only",
              "adam_midpoint", "reference", "reference: tracking only"):
        if n in med:
            table.append(f"| {n} | {len(timer.times[n])} | {med[n]:.1f} | {min(timer.times[n]) * 1e3:.1f} | "
                         f"{med[n] / plain:.1f}x |")
    ratio = med["tracked"] / plain
    table += ["", "| ratio | value | target |", "|---|---:|---|",
              f"| tracked / plain (all rows) | {ratio:.1f}x | <= {TARGET:.0f}x: {'PASS' if ratio <= TARGET else 'FAIL'} |"]
    table.append(f"| tracked_cached / plain (all rows, θ* projections cached as in a replay) | "
                 f"{med['tracked_cached'] / plain:.1f}x | (info) |")
    if "adam_only" in med:
        adam_ratio = med["adam_only"] / plain
        table.append(f"| adam_only / plain (Adam rows only) | {adam_ratio:.1f}x | <= {ADAM_TARGET:.0f}x: "
                     f"{'PASS' if adam_ratio <= ADAM_TARGET else 'FAIL'} |")
    if "adam_midpoint" in med:
        table.append(f"| adam_midpoint / adam_only (the cost of reading ∇R at each step's midpoint) | "
                     f"{med['adam_midpoint'] / med['adam_only']:.2f}x | (info) |")
    if "reference" in med:
        table += [f"| reference / plain | {med['reference'] / plain:.1f}x | (info) |",
                  f"| reference / tracked | {med['reference'] / med['tracked']:.2f}x | (info) |"]
    print("\n".join(table), flush=True)
    report += [""] + table

    if not args.no_memory:
        mem = memory_section(args)  # runs one child at a time; timings there are incidental
        n_params = sum(p.numel() for p in make_model(args.seed, args.device)[0].parameters())
        sec = ["", ("memory: peak RSS growth of one track() call in a fresh process per row (VmHWM after track() "
               "minus VmRSS before it; the peak is reset after setup and 3 plain steps, whose own peak is shown)"), "",
               ("| variant | sites | probes | RSS before MB | plain-step peak MB | peak growth in track() MB | "
               "probes x params x 4 B, MB | sites x params x 4 B, MB | track() s |"),
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in mem:
            sec.append(f"| {r['kind']} | {r['sites']} | {r['probes']} | {r['rss_before_mb']:.0f} | {r['plain_peak_mb']:.0f} | "
                       f"{r['delta_mb']:.0f} | {r['probes'] * n_params * 4 / 2**20:.0f} | "
                       f"{r['sites'] * n_params * 4 / 2**20:.0f} | {r['seconds']:.1f} |")
        print("\n".join(sec), flush=True)
        report += sec

    for order in [] if args.no_curve else args.curve_order:
        curve = curve_section(args, tokens, mask, order)
        sec = ["", (f"curve, order '{order}': tracked step (track + optimizer_step) vs number of sites; sites: "
                    f"{CURVE_ORDERS[order]}; 3 probes per site"), "",
               ("| sites | layers | probes | decomposition VJPs | site tangents | tracked ms | plain ms (same point) | "
               "/ plain |"),
               "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in curve:
            sec.append(f"| {r['sites']} | {','.join(map(str, r['layers']))} | {r['probes']} | {r['decomp_vjps']} | "
                       f"{r['site_tangents']} | {r['tracked_ms']:.0f} | {r['plain_ms_local']:.1f} | {r['ratio']:.1f}x |")
        sec.append(f"(medians; {args.curve_repeats} tracked step(s) per point, 3 plain steps timed before each; "
                   f"the ratio uses the plain median of the same point; plain median over the whole curve "
                   f"{curve[0]['plain_ms']:.1f} ms; load average at the end of the curve {os.getloadavg()[0]:.2f})")
        print("\n".join(sec), flush=True)
        report += sec

    if args.othello:
        sec = [""] + othello_section(args)
        print("\n".join(sec), flush=True)
        report += sec

    if args.flops:
        sec = [""] + flops_section(args, tokens, mask)
        print("\n".join(sec), flush=True)
        report += sec

    if args.matrices:
        sec = [""] + matrices_section(args, tokens, mask)
        print("\n".join(sec), flush=True)
        report += sec

    if args.profile:
        sec = [""] + profile_section(args, tokens, mask)
        print("\n".join(sec), flush=True)
        report += sec

    verdict = (f"RESULT: tracked / plain = {ratio:.1f}x (all rows), the <= {TARGET:.0f}x target is "
               f"{'MET' if ratio <= TARGET else 'NOT met'}")
    if "adam_only" in med:
        verdict += (f"; Adam rows only {adam_ratio:.1f}x, the <= {ADAM_TARGET:.0f}x target is "
                    f"{'MET' if adam_ratio <= ADAM_TARGET else 'NOT met'}")
    tail = ["", verdict, (f"total benchmark time {now() - started:.0f} s, load average at end "
            f"{os.getloadavg()[0]:.2f}")]
    print("\n".join(tail), flush=True)
    report += tail
    if args.markdown:
        n_head = report.index("") if "" in report else len(report)
        md = [f"### {report[0]}", ""] + [f"- {line}" for line in report[1:n_head]] + report[n_head:]
        with open(args.markdown, "w") as f:
            f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
