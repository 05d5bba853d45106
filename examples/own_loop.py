"""Your own PyTorch loop over ntpflow's GPT, with the influence tracker as a callback (docs/own-question.md).

Two passes, as ``ntpflow attribute`` does: train once to get θ*, then run the same loop again (same seeds) with
``tracker.track`` before each step; the exact account (``use_readout``) splits each step's change of the mismatch R
into direct / pre-cached / shared. Limits: Adam (no amsgrad) or plain SGD, weight_decay=0, one parameter group,
ntpflow's loss (``lm_loss`` with the loss mask), a deterministic loop (the second pass must take the first's batches).
"""
import numpy as np
import torch

from ntpflow import GPT, GPTConfig, Site, lm_loss, make_task
from ntpflow.engine.influence import InfluenceTracker, Probe

task = make_task("majority")
data = task.sample(640, np.random.default_rng(0))
tokens, mask = torch.as_tensor(data.tokens), torch.as_tensor(data.loss_mask)
cfg = GPTConfig(vocab_size=task.vocab_size, n_ctx=task.seq_len, n_layer=2, n_head=2, d_model=32)
w = torch.randn(32, generator=torch.Generator().manual_seed(0))  # your own direction, read at ⟨1, 5⟩


def train(steps: int = 20, tracker: InfluenceTracker | None = None) -> tuple[GPT, list[dict]]:
    torch.manual_seed(0)
    model, rows = GPT(cfg), []
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # weight_decay=0
    for step in range(steps):
        i = torch.arange(step * 32, step * 32 + 32) % 512  # rows 512.. are held out
        if tracker is None:  # your loop as it is
            opt.zero_grad()
            lm_loss(model(tokens[i]), tokens[i], mask[i]).backward()
            opt.step()
        else:  # the callback: track before the step, then take the step on the tracker's own gradient
            rows += tracker.track(model, opt, tokens[i], mask[i])
            tracker.optimizer_step(model, opt)
    return model, rows


if __name__ == "__main__":
    final, _ = train()
    tracker = InfluenceTracker(final, [Probe(Site(1, 5), "mine", w)])
    tracker.use_readout(tokens[512:])  # the exact account, read on 128 held-out sequences
    _, rows = train(tracker=tracker)
    total = {}
    for r in rows:
        if r["mismatch"] == "paper" and r["optimizer"] in ("adam", "none") and r["component"] != "risk":
            total[r["component"]] = total.get(r["component"], 0.0) + r["value"]
    print("  ".join(f"{k} {v:.4g}" for k, v in total.items()))
