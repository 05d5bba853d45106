"""The replay's exact account (``ntpflow.engine.replay_account``): through the account's accumulators, the replay
settles every step at the rule the tracker's exact account (``InfluenceTracker.use_readout``) settles it at, and its
rows are the tracker's to float64 rounding, per type subset too; it resumes to the same bits."""

import copy

import pytest
import torch

from ntpflow import GPT, GPTConfig, Site
from ntpflow.engine.influence import InfluenceTracker, Probe
from ntpflow.engine.replay_account import ReplayAccount
from ntpflow.replay.from_account import account_rows
from ntpflow.runs.training import train_step

T, V, D = 8, 7, 16
SITES = [Site(1, 3), Site(2, 5), Site(0, 2)]
KEY = ("step", "layer", "pos", "feature", "feature_type", "mismatch", "component", "optimizer")


def tiny(seed=0) -> GPT:
    return GPT(GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D), seed=seed).double()


def batch(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.rand(n, T, generator=g) > 0.2


def optimizer(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=5e-2)
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9 if name == "momentum" else 0.0)


def trained(opt_name, steps):
    """θ* of ``steps`` training steps from ``tiny(0)``."""
    model = tiny(0)
    opt = optimizer(opt_name, model)
    for tokens, mask in steps:
        train_step(model, opt, tokens, mask)
    return model


@pytest.mark.parametrize("opt_name", ["adam", "momentum", "sgd"])
def test_replay_account_settles_as_the_tracker_and_gives_its_rows(opt_name):
    steps = [batch(10 + t, 6) for t in range(6)]
    held = batch(99, 12)[0]
    g = torch.Generator().manual_seed(7)
    labels = {"a": torch.randint(0, 3, (12, T), generator=g)}
    final_model = trained(opt_name, steps)
    probes = [Probe(s, name, torch.randn(D, generator=g, dtype=torch.float64)) for s in SITES for name in "ab"]
    tracker = InfluenceTracker(copy.deepcopy(final_model), probes)
    tracker.use_readout(held, types=labels)
    model = tiny(0)
    opt = optimizer(opt_name, model)
    want = {}
    for tokens, mask in steps:
        for r in tracker.track(model, opt, tokens, mask):
            want[tuple(r[k] for k in KEY)] = r["value"]
        tracker.optimizer_step(model, opt)
    with torch.no_grad():
        resid = final_model(held, return_resid=True, myopic="none")[1]
    final = {s: resid[s.layer][:, s.pos] for s in SITES}
    model = tiny(0)
    account = ReplayAccount(model, optimizer(opt_name, model), probes, held, final, types=labels)
    for tokens, mask in steps:
        account.train_step(tokens, mask)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), final_model.parameters()))
    assert (account.refined, account.subdivided, account.evaluations) == (
        tracker.refined, tracker.subdivided, tracker.evaluations)
    assert tracker.subdivided > 0  # the test reaches the composite rules
    got = account_rows(account.chunks, final, account.own, account.names, probes, labels)
    assert len(got) == len(want)
    scale: dict = {}  # the largest |row| of each probe at each step: the two paths round relative to it
    for key, value in want.items():
        scale[key[:4]] = max(scale.get(key[:4], 0.0), abs(value))
    for r in got:
        key = tuple(r[k] for k in KEY)
        assert r["value"] == pytest.approx(want[key], rel=0, abs=1e-9 * scale[key[:4]]), key
