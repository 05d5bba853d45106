"""Influence tracking over a run axis (ntpflow.engine.run_axis) against R separate trackers (the exact reading: R
separate accounts), in float64."""

import pytest
import torch

from ntpflow.engine.influence import InfluenceTracker, Probe
from ntpflow.engine.replay_account import ReplayAccount
from ntpflow.engine.run_axis import RunAxisTracker
from ntpflow.model.gpt import GPT
from ntpflow.model.sites import Site
from ntpflow.runs.config import REGIMES, TrainConfig
from ntpflow.runs.group import export_member, group_step, stack_runs
from ntpflow.runs.run import model_config, task_for
from ntpflow.runs.training import make_optimizer

R, BATCH, N_DATA, STEPS = 3, 8, 48, 3
# every kind of site: the embedding, below the last layer at several positions (two share a bucket off the CPU),
# and the last layer (no pre-caching there)
SITES = [Site(0, 2), Site(1, 3), Site(1, 5), Site(2, 4)]


def trackers(final_models, data, reading, gen, models, opts):
    """One tracker per run, 2 random probes per site, each run's own directions and dataset; ``reading``: "start",
    "midpoint", "exact" (each run's account, ``ReplayAccount``, on its own readout set, its first 16 sequences, on
    ``models``/``opts``) or "refined" (the exact account with a tolerance of 0: every step re-integrated up to the
    last rule, the step split in two)."""
    out = []
    for final, d, model, opt in zip(final_models, data, models, opts):
        probes = [Probe(s, f"f{j}", torch.randn(final.cfg.d_model, generator=gen, dtype=torch.float64))
                  for s in SITES for j in range(2)]
        if reading in ("exact", "refined"):
            with torch.no_grad():
                resid = final(d[:16], return_resid=True, myopic="none")[1]
            rule = {"rtol": 0.0, "floor": 0.0, "pieces": (2,)} if reading == "refined" else {}
            out.append(ReplayAccount(model, opt, probes, d[:16], {s: resid[s.layer][:, s.pos] for s in SITES},
                                     levels=(2, 3), **rule))
            continue
        tr = InfluenceTracker(final, probes, midpoint=reading == "midpoint")
        tr.use_dataset(d)
        out.append(tr)
    return out


@pytest.mark.parametrize("reading", ["start", "midpoint", "exact", "refined"])
@pytest.mark.parametrize("regime", REGIMES)
def test_run_axis_rows_equal_separate_trackers_float64(regime, reading):
    """The R members' rows of one vmapped step, against each member's own ``InfluenceTracker.track`` on its own
    model and Adam (exported from the group's stack), over several Adam steps: the same rows, values equal to
    rounding (batched kernels round differently): within 1e3 · eps64 of the step's largest |value|. With the exact
    account, each step's accumulators (within 1e3 · eps64 of each tensor's largest entry) and the refinement
    counters."""
    compare_with_separate_trackers(TrainConfig(task="majority", d_model=16, n_head=2, batch_size=BATCH, regime=regime),
                                   reading)


@pytest.mark.parametrize("reading", ["start", "exact"])
@pytest.mark.parametrize("optim", [dict(optimizer="sgd", lr=0.1),
                                   dict(optimizer="sgd", momentum=0.9, lr=0.1, warmup=2, decay="cosine")],
                         ids=["sgd", "sgd-momentum-scheduled"])
def test_run_axis_rows_equal_separate_trackers_under_sgd_float64(optim, reading):
    """As above for a group trained with SGD, plain (the SGD rows only) and with momentum on a schedule (the
    ``momentum`` rows beside the SGD direction's)."""
    compare_with_separate_trackers(TrainConfig(task="majority", d_model=16, n_head=2, batch_size=BATCH, **optim),
                                   reading)


def compare_with_separate_trackers(cfg: TrainConfig, reading: str) -> None:
    """R members of ``cfg`` tracked over the run axis and alone for STEPS steps: rows, values, state (see above)."""
    mcfg = model_config(cfg, task_for(cfg))
    models = [GPT(mcfg, seed=s).double() for s in range(R)]
    opts = [make_optimizer(m, cfg) for m in models]
    finals = [GPT(mcfg, seed=10 + s).double() for s in range(R)]
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(2, mcfg.vocab_size, (R, N_DATA, mcfg.n_ctx), generator=gen)
    alone = trackers(finals, data, reading, torch.Generator().manual_seed(2), models, opts)
    axis = RunAxisTracker(trackers(finals, data, reading, torch.Generator().manual_seed(2), models, opts))
    stack, group_opt = stack_runs(models, opts, cfg)
    eps = torch.finfo(torch.float64).eps
    for _ in range(STEPS):
        ids = torch.randint(0, N_DATA, (R, BATCH), generator=gen)
        tokens = torch.stack([data[r][ids[r]] for r in range(R)])
        mask = torch.rand(tokens.shape, generator=gen) > 0.2
        batched = axis.track(stack, group_opt, range(R), tokens, mask, ids)
        for r in range(R):
            export_member(stack, r, group_opt, models[r], opts[r])
            if isinstance(alone[r], ReplayAccount):  # the step's chunk (its accumulators) against the lone account's
                alone[r].account_step(tokens[r], mask[r])
                assert batched[r] == []
                (_, want_chunk), (_, got_chunk) = alone[r].chunks[-1], axis.trackers[r].chunks[-1]
                assert want_chunk.keys() == got_chunk.keys()
                for k, want in want_chunk.items():
                    torch.testing.assert_close(got_chunk[k], want, rtol=0,
                                               atol=1e3 * eps * max(want.abs().max().item(), 1e-300))
                continue
            rows = alone[r].track(models[r], opts[r], tokens[r], mask[r], example_ids=ids[r])
            assert [{**x, "value": 0} for x in batched[r]] == [{**x, "value": 0} for x in rows]
            want = torch.tensor([x["value"] for x in rows], dtype=torch.float64)
            got = torch.tensor([x["value"] for x in batched[r]], dtype=torch.float64)
            assert want.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=0, atol=1e3 * eps * want.abs().max().item())
        group_step(stack, group_opt, tokens, mask)
    for a, b in zip(alone, axis.trackers):  # the first moments, as each member's state_dict holds them
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and int(sb["step"]) == STEPS
        assert (a.refined, a.evaluations, a.subdivided) == (b.refined, b.evaluations, b.subdivided)
        if reading == "refined":  # 2 + 3 points, then 2 pieces of 3
            assert b.refined == b.subdivided == STEPS and b.evaluations == STEPS * (5 + 6)
        for k in sa:
            torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=1e3 * eps * max(sa[k].abs().max().item(), 1e-300))


def test_run_axis_refuses_members_that_differ():
    cfg = TrainConfig(task="majority", d_model=16, n_head=2)
    final = GPT(model_config(cfg, task_for(cfg)))
    w = torch.ones(16)
    with pytest.raises(ValueError, match="same sites"):
        RunAxisTracker([InfluenceTracker(final, [Probe(Site(1, 3), "a", w)]),
                        InfluenceTracker(final, [Probe(Site(1, 4), "a", w)])])
    with pytest.raises(ValueError, match="same sites"):
        RunAxisTracker([InfluenceTracker(final, [Probe(Site(1, 3), "a", w)]),
                        InfluenceTracker(final, [Probe(Site(1, 3), "a", w)], midpoint=True)])
    exact = InfluenceTracker(final, [Probe(Site(1, 3), "a", w)])
    exact.use_readout(torch.zeros(4, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="same sites"):
        RunAxisTracker([InfluenceTracker(final, [Probe(Site(1, 3), "a", w)]), exact])
    with pytest.raises(ValueError, match="ReplayAccount"):
        RunAxisTracker([exact, exact])
