"""Your own PyTorch loop over ntpflow's GPT, with the exact account as a callback (docs/own-question.md).

One pass: ``account.step`` takes each optimizer step (backward, gradient-norm clipping, the step) and keeps the
account's accumulators; ``account.finish`` reads any direction's split at the end, with the trained weights as θ*.
This loop uses AdamW with weight decay (its own row, ``decay``), a warmup-cosine schedule and clipping; nothing is
replayed, so the loop need not repeat itself.
"""
import math

import numpy as np
import torch

import ntpflow
from ntpflow import GPT, GPTConfig, Site, make_task

task = make_task("majority")
data = task.sample(640, np.random.default_rng(0))
tokens, mask = torch.as_tensor(data.tokens), torch.as_tensor(data.loss_mask)
cfg = GPTConfig(vocab_size=task.vocab_size, n_ctx=task.seq_len, n_layer=2, n_head=2, d_model=32)
w = torch.randn(32, generator=torch.Generator().manual_seed(0))  # your own direction, read at ⟨1, 5⟩
STEPS, WARMUP = 20, 4


def train(steps: int = STEPS) -> tuple[GPT, ntpflow.Account]:
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warmup, then cosine decay
        opt, lambda t: min(1.0, (t + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * t / steps)))
    account = ntpflow.Account(model, opt, [Site(1, 5)], readout=tokens[512:], clip=1.0)  # 128 held-out sequences
    for step in range(steps):
        i = torch.arange(step * 32, step * 32 + 32) % 512  # rows 512.. are held out
        account.step(tokens[i], mask[i])  # instead of backward, clip_grad_norm_ and opt.step()
        schedule.step()
    return model, account


if __name__ == "__main__":
    model, account = train()
    result = account.finish({"mine": (Site(1, 5), w)})
    paper = next(e for e in result.summary if e["mismatch"] == "paper")
    print("  ".join(f"{k} {paper[f'adamw_{k}']:.4g}" for k in ("direct", "pre_cached", "shared", "decay", "full"))
          + f"  change {paper['change']:.4g}  residual {paper['residual']:.2g}")
