"""Float32 accuracy of the attribution engine: influence rows of a float32 run against a float64 run of the same engine.

Load: the toy model of ``bench_attribution.py`` (2 layers, d_model 128, T 21), 9 sites (layers 0–2 × positions 3, 10,
19), 3 random probes per site, 3 random feature types per probe, random masked positions (20 %), 3 Adam steps
(lr 1e-3) at batch 64, both models from the same seeds. Prints, per component (risk, direct, pre_cached, shared,
full), max |float32 − float64| / max |float64| over all rows of that component, as one JSON line.

    python benchmarks/attribution_float32.py [SEED]    # the ntpflow on sys.path; SEED (default 0) for models and data
    PYTHONPATH=/path/to/other/checkout python benchmarks/attribution_float32.py   # another engine, for an A/B
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attribution import gpt_config  # noqa: E402

from ntpflow import GPT, Site, lm_loss
from ntpflow.engine.influence import InfluenceTracker, Probe


def run(dtype: torch.dtype, seed: int = 0) -> dict:
    """{(step, feature, feature_type, mismatch, component, optimizer): value} of 3 tracked Adam steps in ``dtype``."""
    cfg = gpt_config()
    model, final = GPT(cfg, seed=seed).to(dtype), GPT(cfg, seed=seed + 1000).to(dtype)
    g = torch.Generator().manual_seed(seed + 2)
    sites = [Site(k, p) for k in range(3) for p in (3, 10, 19)]
    probes = [Probe(s, f"f{s.layer}_{s.pos}_{j}", torch.randn(cfg.d_model, generator=g).to(dtype))
              for s in sites for j in range(3)]
    tracker = InfluenceTracker(final, probes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rows = []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * seed + 10 + step)
        tokens = torch.randint(0, cfg.vocab_size, (64, cfg.n_ctx), generator=gen)
        mask = torch.rand(64, cfg.n_ctx, generator=gen) > 0.2
        types = {p.name: torch.randint(0, 3, (64, cfg.n_ctx), generator=gen) for p in probes}
        rows += tracker.track(model, opt, tokens, mask, types)
        opt.zero_grad()
        lm_loss(model(tokens), tokens, mask).backward()
        opt.step()
    return {(r["step"], r["feature"], r["feature_type"], r["mismatch"], r["component"], r["optimizer"]): r["value"]
            for r in rows}


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    torch.set_num_threads(1)
    low, high = run(torch.float32, seed), run(torch.float64, seed)
    out = {}
    for comp in ("risk", "direct", "pre_cached", "shared", "full"):
        keys = [k for k in high if k[4] == comp]
        out[comp] = f"{max(abs(low[k] - high[k]) for k in keys) / max(abs(high[k]) for k in keys):.2e}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
