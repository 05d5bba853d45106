"""Run groups (ntpflow.runs.group): the run axis against separate runs, resume, replay (one member, and the whole group
in one replay, against the per-member replay), bad input, the paper script."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ntpflow.runs.group as run_group
from ntpflow.engine.exact import ExactAccount
from ntpflow.files import SimulatedKill, load_tensors
from ntpflow.model.gpt import GPT
from ntpflow.model.loss import lm_loss
from ntpflow.model.sites import Site
from ntpflow.model.stack import RunStack
from ntpflow.replay.attribution import attribute, attribute_group
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.account import AccountSpec
from ntpflow.runs.config import REGIMES, TrainConfig
from ntpflow.runs.data import DataOrder, make_datasets
from ntpflow.runs.group import GroupData, export_member, group_step, stack_runs, train_group
from ntpflow.runs.run import Checkpoints, Run, model_config, model_tensors, task_for
from ntpflow.runs.training import TrainingDiverged, make_optimizer, train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(task="majority", steps=12, d_model=16, n_head=2, batch_size=16, n_train=320, n_eval=64, eval_every=6,
            ckpt_every=4, log_every=2)
# Tolerance of a group member's weights against the same run trained alone (docs/run-groups.md): the batched
# kernels may round differently, and Adam turns a last-bit difference of a near-zero gradient into up to ~lr per
# step; after TINY's 12 steps the measured gap is ~1e-6, the bound lr * steps / 10 = 1.2e-3 is far from any real
# divergence (the weights move by ~lr * steps = 1.2e-2 in that time).
TOL = 1e-3 * 12 / 10
SGD = dict(optimizer="sgd", momentum=0.9, lr=0.1, warmup=3, decay="cosine", final_lr_frac=0.1)  # the control's kind


def configs(regime="vanilla", seeds=(0, 1), **kw):
    return [TrainConfig(regime=regime, seed=s, **{**TINY, **kw}) for s in seeds]


def weights(run: Run, which="final") -> dict[str, torch.Tensor]:
    return model_tensors(load_tensors(run.weights_path(which)))


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("regime", REGIMES)
def test_run_axis_gradients_equal_separate_runs_float64(regime):
    """Exact maths: each run's gradient through the stacked model is its own model's gradient (float64)."""
    cfgs = configs(regime, seeds=(0, 1, 2))
    mcfg = model_config(cfgs[0], task_for(cfgs[0]))
    models = [GPT(mcfg, seed=c.seed).double() for c in cfgs]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mcfg.vocab_size, (3, 8, mcfg.n_ctx), generator=gen)
    mask = torch.rand(3, 8, mcfg.n_ctx, generator=gen) > 0.3
    stack = RunStack(models)
    stack.losses(tokens, mask).sum().backward()
    for r, m in enumerate(models):
        lm_loss(m(tokens[r]), tokens[r], mask[r]).backward()
        for s, (name, p) in zip(stack.stacked, m.named_parameters()):
            torch.testing.assert_close(s.grad[r], p.grad, rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("optim", [{}, dict(warmup=2, decay="cosine"), SGD],
                         ids=["adam", "adam-scheduled", "sgd-momentum-scheduled"])
def test_one_optimizer_over_stacked_params_is_separate_optimizers(optim):
    """Adam and SGD with momentum are elementwise, and a schedule is the same for every run: a step of the stacked
    optimizer equals each run's own optimizer step, state and learning rate included (float64), also after the group
    is rebuilt from its members' optimizers mid-schedule (as a resumed group is); ``export_member`` gives each run's
    state back."""
    cfgs = configs(seeds=(0, 1), **optim)
    mcfg = model_config(cfgs[0], task_for(cfgs[0]))
    models = [GPT(mcfg, seed=c.seed).double() for c in cfgs]
    opts = [make_optimizer(m, c) for m, c in zip(models, cfgs)]
    stack, group_opt = stack_runs(models, opts, cfgs[0])
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 3:  # a resumed group: stacked again from the members' models and optimizers
            stack, group_opt = stack_runs(models, opts, cfgs[0])
        for s in stack.stacked:
            s.grad = torch.randn(s.shape, generator=gen, dtype=s.dtype)
        for r, m in enumerate(models):
            for s, p in zip(stack.stacked, m.parameters()):
                p.grad = s.grad[r].clone()
            opts[r].step()
        group_opt.step()
        assert group_opt.param_groups[0]["lr"] == opts[0].param_groups[0]["lr"]
    for r, m in enumerate(models):
        for s, (name, p) in zip(stack.stacked, m.named_parameters()):
            torch.testing.assert_close(s.detach()[r], p.detach(), rtol=1e-12, atol=1e-15, msg=name)
        twin = GPT(mcfg).double()
        twin_opt = make_optimizer(twin, cfgs[r])
        export_member(stack, r, group_opt, twin, twin_opt)
        assert twin_opt.param_groups[0]["lr"] == opts[r].param_groups[0]["lr"]
        for p, q in zip(m.parameters(), twin.parameters()):
            mine, theirs = opts[r].state[p], twin_opt.state[q]
            assert mine.keys() == theirs.keys()
            for k in mine:
                torch.testing.assert_close(theirs[k], mine[k], rtol=1e-12, atol=1e-15, msg=k)


def test_group_data_is_each_runs_own_order():
    cfgs = configs(seeds=(3, 5))
    data = GroupData(cfgs, "cpu")
    for step in (0, 7, 25):  # 25: a later epoch (20 batches per epoch)
        tokens, mask = data.batch(step)
        for r, c in enumerate(cfgs):
            train_set, _ = make_datasets(c, task_for(c))
            idx = DataOrder(c.seed, c.n_train, c.batch_size)(step).numpy()
            assert torch.equal(tokens[r], torch.as_tensor(train_set.tokens[idx]))
            assert torch.equal(mask[r], torch.as_tensor(train_set.loss_mask[idx]))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    cfgs = configs()
    runs = train_group(cfgs, [root / f"g{c.seed}" for c in cfgs], progress=False)
    return root, cfgs, runs


def test_group_members_are_ordinary_runs_close_to_separate_runs(group, tmp_path):
    root, cfgs, runs = group
    for r, (c, run) in enumerate(zip(cfgs, runs)):
        opened = Run.open(run.dir)
        assert opened.done and opened.cfg == c and opened.checkpoints() == [4, 8]
        assert json.loads((run.dir / "group.json").read_text())["index"] == r
        alone = train(c, tmp_path / f"alone{c.seed}", progress=False)
        assert same_bits(weights(run, "init"), weights(alone, "init"))
        for k, v in weights(alone).items():
            assert (weights(run)[k] - v).abs().max() <= TOL, k
        got, want = run.metrics(), alone.metrics()
        assert [(m["step"], m["kind"]) for m in got] == [(m["step"], m["kind"]) for m in want]
        first = next(i for i, m in enumerate(want) if m["kind"] == "train")
        assert got[first]["loss"] == pytest.approx(want[first]["loss"], rel=1e-5)  # same data order from step 0


def test_killed_group_resumes_to_the_same_bits(group, tmp_path, monkeypatch):
    root, cfgs, runs = group
    real, calls = Checkpoints.save, []

    def dying_save(self, step, *args, **kw):  # dies after the first member's checkpoint at step 8 is written
        real(self, step, *args, **kw)
        calls.append(self.path(step))
        if step == 8:
            raise KeyboardInterrupt("injected kill")

    monkeypatch.setattr(Checkpoints, "save", dying_save)
    dirs = [tmp_path / f"g{c.seed}" for c in cfgs]
    with pytest.raises(KeyboardInterrupt):
        train_group(cfgs, dirs, progress=False)
    monkeypatch.setattr(Checkpoints, "save", real)
    assert [Run.open(d).checkpoints() for d in dirs] == [[4, 8], [4]]
    resumed = train_group(cfgs, dirs, progress=False)
    for a, b in zip(resumed, runs):
        assert same_bits(weights(a), weights(b))
        assert a.metrics() == b.metrics()


def test_replay_of_a_member_is_bit_identical_and_resumes(group, monkeypatch):
    root, cfgs, runs = group
    run = runs[1]
    from ntpflow.replay import member as replay

    real_step = replay.ReplayAccount.account_step

    def dying_step(self, *a, **kw):  # killed at step 6: the replay state at step 4 stays
        if self.step == 6:
            raise KeyboardInterrupt("injected kill")
        return real_step(self, *a, **kw)

    monkeypatch.setattr(replay.ReplayAccount, "account_step", dying_step)
    sites, features = [Site(1, 5)], ["is_majority_<0>"]
    with pytest.raises(KeyboardInterrupt):
        attribute(run.dir, AttributionSpec(sites, features), device="cpu", progress=False)
    assert resume_points(run.dir / "attribution") == [4]
    monkeypatch.setattr(replay.ReplayAccount, "account_step", real_step)
    out = attribute(run.dir, AttributionSpec(sites, features),
                    device="cpu", progress=False)  # raises if not bit-identical
    assert (out / "influence.parquet").exists()
    # a block size off the checkpoint grid: the group is rebuilt from its step-4 checkpoint and stepped to 6
    attribute(run.dir, AttributionSpec(sites, features, block=3), out_dir=root / "attr3", device="cpu", progress=False)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but its lock: relative path -> bytes; summary.json without its stamp's date (the
    second it was written), which is all that may differ."""
    out = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
           if p.is_file() and p.name != ".lock"}
    if "summary.json" in out:
        summary = json.loads(out["summary.json"])
        assert summary["stamp"].pop("date")
        out["summary.json"] = json.dumps(summary).encode()
    return out


def resume_points(folder: Path) -> list[int]:
    from ntpflow.replay import member as replay

    return replay.resume_points(folder).steps()


def killed_group_replay(monkeypatch, what, outs, opts, expect):
    """Run ``attribute_group(*what, out_dirs=outs, **opts)``, killed right after the first resume point it writes;
    then check the members' resume points against ``expect``."""
    monkeypatch.setenv("NTPFLOW_FAULT", "attribute:after_checkpoint")
    with pytest.raises(SimulatedKill):
        attribute_group(*what, out_dirs=outs, **opts)
    monkeypatch.delenv("NTPFLOW_FAULT")
    assert [resume_points(o) for o in outs] == expect


def test_group_replay_writes_each_members_attribution_bit_for_bit_and_resumes(group, tmp_path, monkeypatch):
    """One replay of the group that tracks both members one after another (``run_axis=False``), against each
    member's own replay (``attribute``, the oracle): every file of each member's folder has the same bytes, also
    after kills that leave the members at different resume points, and a member already finished is skipped."""
    _, cfgs, runs = group
    dirs = [run.dir for run in runs]
    sites, features = [Site(1, 5), Site(2, 3)], ["is_majority_<0>"]
    opts = dict(device="cpu", progress=False, run_axis=False)  # resume points 3, 6, 9, 12 (block 3): off the
    # checkpoint grid (4, 8)
    spec = AttributionSpec(sites, features, block=3)
    alone = [attribute(d, spec, out_dir=tmp_path / f"alone{r}", device="cpu", progress=False)
             for r, d in enumerate(dirs)]
    want = [tree(o) for o in alone]
    assert "influence.parquet" in want[0] and "state/step_000012.safetensors" in want[1]

    def killed(outs, expect):
        killed_group_replay(monkeypatch, (dirs, spec), outs, opts, expect)

    mixed = [tmp_path / "mixed0", tmp_path / "mixed1"]
    killed(mixed, [[3], []])  # member 1 resumes from step 0; member 0 joins the group at its step 3
    both = [tmp_path / "both0", tmp_path / "both1"]
    killed(both, [[3], []])
    killed(both, [[3], [3]])  # the group is rebuilt from its training checkpoints and stepped to 3
    for outs in ([tmp_path / "fresh0", tmp_path / "fresh1"], mixed, both):
        assert attribute_group(dirs, spec, out_dirs=outs, **opts) == outs  # raises unless θ_T is exact
        assert [tree(o) for o in outs] == want  # exact: same ops in one process
    finished = tree(alone[0])
    attribute_group(dirs, spec, out_dirs=[alone[0], tmp_path / "only1"], **opts)  # member 0 skipped
    assert tree(alone[0]) == finished and tree(tmp_path / "only1") == want[1]  # exact: same ops in one process


def parquet_rows(folder: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(folder / "influence.parquet").to_pylist()


def row_key(row: dict) -> tuple:
    """A row's place: its step, site, feature, type, mismatch, component and optimizer."""
    return tuple(row[k] for k in ("step", "layer", "pos", "feature", "feature_type", "mismatch", "component",
                                  "optimizer"))


def test_group_replay_over_the_run_axis_agrees_and_resumes_to_the_same_bits(group, tmp_path, monkeypatch):
    """The default group replay tracks the members in one vmapped pass: against each member's own replay
    (``attribute``) the same rows, values equal to rounding (float32 runs: within 1e3 · eps32 of the largest
    |value| of the column); the spec says how it was tracked. Killed so that the members stand at different resume
    points, or both at one, it resumes (the later member goes back to the common step) to the same bytes as an
    uninterrupted replay."""
    _, cfgs, runs = group
    dirs = [run.dir for run in runs]
    sites, features = [Site(1, 5), Site(2, 3)], ["is_majority_<0>"]
    spec, opts = AttributionSpec(sites, features, block=3), dict(device="cpu", progress=False)
    fresh = attribute_group(dirs, spec, out_dirs=[tmp_path / "fresh0", tmp_path / "fresh1"], **opts)
    eps = torch.finfo(torch.float32).eps
    for r, (d, out) in enumerate(zip(dirs, fresh)):
        alone = attribute(d, spec, out_dir=tmp_path / f"alone{r}", **opts)
        assert json.loads((out / "spec.json").read_text()) == {
            **json.loads((alone / "spec.json").read_text()), "run_axis": True}
        want, got = (sorted(parquet_rows(o), key=row_key) for o in (alone, out))  # the paths order rows apart
        assert [{**x, "value": 0, "cumulative": 0} for x in got] == [{**x, "value": 0, "cumulative": 0} for x in want]
        for col in ("value", "cumulative"):
            a = torch.tensor([x[col] for x in want], dtype=torch.float64)
            torch.testing.assert_close(torch.tensor([x[col] for x in got], dtype=torch.float64), a, rtol=0,
                                       atol=1e3 * eps * a.abs().max().item())
    want = [tree(o) for o in fresh]

    def killed(outs, expect):
        killed_group_replay(monkeypatch, (dirs, spec), outs, opts, expect)

    mixed = [tmp_path / "mixed0", tmp_path / "mixed1"]
    killed(mixed, [[3], []])  # member 0 goes back to step 0, where member 1 resumes
    killed(mixed, [[3], []])  # ... and again
    from ntpflow.replay import member as replay

    real, saved = replay.save_resume_point, []

    def dying_save(*a, **kw):  # dies once both members have written their step-3 resume point
        real(*a, **kw)
        saved.append(a[3])
        if len(saved) == 2:
            raise KeyboardInterrupt("injected kill")

    both = [tmp_path / "both0", tmp_path / "both1"]
    monkeypatch.setattr(replay, "save_resume_point", dying_save)
    with pytest.raises(KeyboardInterrupt):
        attribute_group(dirs, spec, out_dirs=both, **opts)
    monkeypatch.setattr(replay, "save_resume_point", real)
    assert [resume_points(o) for o in both] == [[3], [3]]  # both resume from step 3: the group is rebuilt from its
    # training checkpoints and stepped to 3
    for outs in (mixed, both):
        assert attribute_group(dirs, spec, out_dirs=outs, **opts) == outs  # raises unless θ_T is exact
        assert [tree(o) for o in outs] == want  # exact: same ops in one process
    unfinished = [tmp_path / "k0", tmp_path / "k1"]
    killed(unfinished, [[3], []])
    with pytest.raises(ValueError, match="tracked over its group's run axis"):  # resumed the other way: refused
        attribute(dirs[0], spec, out_dir=unfinished[0], **opts)
    assert attribute(dirs[0], spec, out_dir=fresh[0], **opts) == fresh[0]  # finished: skipped either way
    assert tree(fresh[0]) == want[0]


def test_attribute_cli_tracks_a_group_in_one_replay(group, capsys):
    """``ntpflow attribute MEMBER --group``: every member's RUN_DIR/attribution, one output folder per line."""
    from ntpflow.cli import main

    _, _, runs = group
    assert main(["-q", "attribute", str(runs[0].dir), "--group", "--sites", "1:5", "--features", "is_majority_<0>",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split() == [str((run.dir / "attribution").resolve()) for run in runs]
    assert all((run.dir / "attribution" / "influence.parquet").exists() for run in runs)


def test_group_replay_bad_input_is_a_one_line_error(group, tmp_path, capsys):
    from ntpflow.cli import main

    _, cfgs, runs = group
    lone = train(cfgs[0], tmp_path / "lone", progress=False)
    other = train_group(cfgs, [tmp_path / "o0", tmp_path / "o1"], progress=False)  # the same configs elsewhere
    for dirs, flags, message in (([runs[0].dir, lone.dir], [], "trained alone"),
                                 ([lone.dir], ["--group"], "trained alone"),
                                 ([runs[0].dir, other[1].dir], [], "not all members of one run group"),
                                 ([runs[0].dir, runs[0].dir], [], "given twice"),
                                 ([runs[0].dir, runs[1].dir], ["--out", str(tmp_path / "x")], "--out takes a single"),
                                 ([runs[0].dir, runs[1].dir], ["--group"], "--group takes one run dir")):
        assert main(["-q", "attribute", *map(str, dirs), *flags, "--sites", "1:5", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists() and not (lone.dir / "attribution").exists()


def test_replay_stepper_of_a_member_is_its_group_step(group):
    """The stepper a replay gets: the group's step for a member, ``train_step`` for a run trained alone."""
    _, cfgs, runs = group
    model = runs[0].load_model("init")
    opt = make_optimizer(model, cfgs[0])
    stepper = run_group.replay_stepper(runs[0], model, opt, torch.device("cpu"))
    assert isinstance(stepper, run_group.GroupReplay)
    data = GroupData(cfgs, "cpu")
    stepper(0, *[x[0] for x in data.batch(0)])
    models = [run.load_model("init") for run in runs]
    stack, gopt = stack_runs(models, [make_optimizer(m, c) for m, c in zip(models, cfgs)], cfgs[0])
    group_step(stack, gopt, *data.batch(0))
    assert all(torch.equal(p, s[0]) for p, s in zip(model.parameters(), stack.stacked))  # exact: stacking copies the tensors
    assert int(opt.state[next(model.parameters())]["step"]) == 1


def test_a_diverging_group_stops_without_done(tmp_path):
    cfgs = configs(lr=1e30)  # Adam's first step moves every weight by ~lr: the next loss is inf or nan
    with pytest.raises(TrainingDiverged, match="non-finite"):
        train_group(cfgs, [tmp_path / "a", tmp_path / "b"], progress=False)
    assert not (tmp_path / "a" / "DONE").exists() and not (tmp_path / "b" / "DONE").exists()


def test_bad_groups_are_clean_errors_and_write_nothing(tmp_path):
    mixed = [TrainConfig(regime="vanilla", seed=0, **TINY), TrainConfig(regime="myopic", seed=1, **TINY)]
    with pytest.raises(ValueError, match="regime"):
        train_group(mixed, [tmp_path / "a", tmp_path / "b"], progress=False)
    with pytest.raises(ValueError, match="distinct"):
        train_group(configs(), [tmp_path / "a", tmp_path / "a"], progress=False)
    assert not any(tmp_path.iterdir())
    alone = configs(seeds=(0,))[0]
    train(alone, tmp_path / "alone", progress=False)
    with pytest.raises(ValueError, match="trained alone"):
        train_group(configs(), [tmp_path / "alone", tmp_path / "other"], progress=False)


# ---------------------------------------------------------------- the account kept while a group trains

ACCOUNT = AccountSpec((Site(1, 5),), readout=32, chunks=3)


@pytest.fixture(scope="module")
def accounted_group(tmp_path_factory):
    """The group of ``group`` trained again, member 0 keeping the account at site 1:5 (readout 32, chunks of 4)."""
    root = tmp_path_factory.mktemp("accounted")
    cfgs = configs()
    return train_group(cfgs, [root / f"a{c.seed}" for c in cfgs], progress=False, accounts=[ACCOUNT, None])


def test_a_group_keeping_an_account_has_the_same_bits_and_attribute_reads_it(group, accounted_group, tmp_path):
    """The weights are the group's without the account, bit for bit; member 0's attribution is read from its account
    (no replay) and equals the replay of it (through its group's steps) to float32 rounding and quadrature; a group
    attribution reads member 0 and replays member 1."""
    _, _, plain = group
    for a, b in zip(accounted_group, plain):
        assert same_bits(weights(a), weights(b)) and a.metrics() == b.metrics()
    member, other = accounted_group
    assert (member.dir / "account" / "final.safetensors").exists() and not (other.dir / "account").exists()
    spec = AttributionSpec([Site(1, 5)], ["is_majority_<0>", "is_majority_<1>"])
    kept = attribute(member.dir, spec, out_dir=tmp_path / "kept", device="cpu", progress=False)
    replayed = attribute(member.dir, replace(spec, replay=True, readout=32), out_dir=tmp_path / "replayed",
                         device="cpu", progress=False)
    a, b = (json.loads((o / "summary.json").read_text()) for o in (kept, replayed))
    assert a["account"] and "account" not in b and len(a["probes"]) == len(b["probes"]) == 4
    for x, y in zip(a["probes"], b["probes"]):
        assert (x["feature"], x["mismatch"]) == (y["feature"], y["mismatch"])
        for k in ("change", "adam_direct", "adam_pre_cached", "adam_shared", "adam_full", "sgd_direct", "sgd_full"):
            assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-4 * y["R0_eval"]), k
    outs = attribute_group([r.dir for r in accounted_group], spec, out_dirs=[tmp_path / "g0", tmp_path / "g1"],
                           device="cpu", progress=False)
    specs = [json.loads((o / "spec.json").read_text()) for o in outs]
    assert specs[0].get("account") is True and "account" not in specs[1]
    assert (outs[0] / "influence.parquet").read_bytes() == (kept / "influence.parquet").read_bytes()


def test_a_members_account_is_its_own_steps_account_float64():
    """Exact maths: the account a member keeps inside a group (its state exported before each group step, the
    account taken from there, the group stepping) equals the account of the same run trained alone, step for step
    (float64; the group's batched kernels round differently from a lone run's, so to float64 rounding grown over four
    Adam steps: measured 12 eps, bound 1e4 eps of each tensor's largest |value|)."""
    cfgs = configs(seeds=(0, 1))
    mcfg = model_config(cfgs[0], task_for(cfgs[0]))
    models = [GPT(mcfg, seed=c.seed).double() for c in cfgs]
    alone = GPT(mcfg, seed=1).double()
    gen = torch.Generator().manual_seed(0)
    held = torch.randint(0, mcfg.vocab_size, (6, mcfg.n_ctx), generator=gen)
    batches = [(torch.randint(0, mcfg.vocab_size, (2, 8, mcfg.n_ctx), generator=gen),
                torch.rand(2, 8, mcfg.n_ctx, generator=gen) > 0.3) for _ in range(4)]
    stack, group_opt = stack_runs(models, [make_optimizer(m, cfgs[0]) for m in models], cfgs[0])
    member = GPT(mcfg, seed=1).double()
    member_opt = make_optimizer(member, cfgs[0])
    sites = [Site(1, 5), Site(2, 3)]
    kept = ExactAccount(member, member_opt, sites, held, levels=(8,), pieces=())
    own = ExactAccount(alone, make_optimizer(alone, cfgs[0]), sites, held, levels=(8,), pieces=())
    for tokens, mask in batches:
        export_member(stack, 1, group_opt, member, member_opt)
        kept.account_step(tokens[1], mask[1])
        group_step(stack, group_opt, tokens, mask)
        own.train_step(tokens[1], mask[1])
    assert len(kept.chunks) == len(own.chunks) == 4
    for (i, x), (j, y) in zip(kept.chunks, own.chunks):
        assert i == j and x.keys() == y.keys()
        for k in x:
            tol = 1e4 * torch.finfo(torch.float64).eps
            torch.testing.assert_close(x[k], y[k], rtol=tol, atol=tol * float(y[k].abs().max()), msg=k)


def test_a_killed_group_resumes_to_the_same_account(accounted_group, tmp_path, monkeypatch):
    """Killed right after the checkpoint of step 4 (inside the chunk of steps 4–7), rerun: every chunk and the final
    file of the member's account have the bits of the uninterrupted group's."""
    cfgs = configs()
    dirs = [tmp_path / f"a{c.seed}" for c in cfgs]
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")
    with pytest.raises(SimulatedKill):
        train_group(cfgs, dirs, progress=False, accounts=[ACCOUNT, None])
    monkeypatch.delenv("NTPFLOW_FAULT")
    train_group(cfgs, dirs, progress=False, accounts=[ACCOUNT, None])
    ref, got = accounted_group[0].account, Run.open(dirs[0]).account
    assert [p.name for p in got.chunk_files()] == [p.name for p in ref.chunk_files()] and len(ref.chunk_files()) == 3
    for a, b in zip(ref.chunk_files() + [ref.final], got.chunk_files() + [got.final]):
        x, y = load_tensors(a), load_tensors(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), b.name


def test_a_group_account_on_a_member_begun_without_it_is_refused(group, tmp_path):
    """A member begun without the account cannot take one later (its early steps were not accounted for)."""
    _, cfgs, runs = group
    with pytest.raises(ValueError, match="trained without --account"):
        train_group(cfgs, [r.dir for r in runs], progress=False, accounts=[ACCOUNT, None])
    with pytest.raises(ValueError, match="one account"):
        train_group(cfgs, [tmp_path / "x", tmp_path / "y"], progress=False, accounts=[ACCOUNT])
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- SGD with momentum on a schedule (the control)

@pytest.fixture(scope="module")
def sgd_group(tmp_path_factory):
    """Two members trained with SGD with momentum 0.9 on a warmup-cosine schedule, member 0 keeping the account."""
    root = tmp_path_factory.mktemp("sgd")
    cfgs = configs(**SGD)
    return cfgs, train_group(cfgs, [root / f"s{c.seed}" for c in cfgs], progress=False, accounts=[ACCOUNT, None])


def test_an_sgd_group_is_its_runs_trained_alone_and_resumes_to_the_same_bits(sgd_group, tmp_path, monkeypatch):
    """Each member is the run ``train`` makes alone, schedule included (weights within TOL, the first loss to float32
    rounding); killed after a checkpoint, the group resumes on the schedule to the same bits and the same account."""
    cfgs, runs = sgd_group
    for c, run in zip(cfgs, runs):
        alone = train(c, tmp_path / f"alone{c.seed}", progress=False)
        for k, v in weights(alone).items():
            assert (weights(run)[k] - v).abs().max() <= TOL, k
        got, want = ([m["loss"] for m in r.metrics() if m["kind"] == "train"] for r in (run, alone))
        assert got[0] == pytest.approx(want[0], rel=1e-5) and got[-1] == pytest.approx(want[-1], rel=1e-3)
    dirs = [tmp_path / f"s{c.seed}" for c in cfgs]
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")
    with pytest.raises(SimulatedKill):
        train_group(cfgs, dirs, progress=False, accounts=[ACCOUNT, None])
    monkeypatch.delenv("NTPFLOW_FAULT")
    resumed = train_group(cfgs, dirs, progress=False, accounts=[ACCOUNT, None])
    for a, b in zip(resumed, runs):
        assert same_bits(weights(a), weights(b)) and a.metrics() == b.metrics()
    x, y = (load_tensors(r.account.final) for r in (runs[0], resumed[0]))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_an_sgd_groups_account_and_replays_agree(sgd_group, tmp_path):
    """Member 0's attribution read from the account it kept in the group equals its replay through the group's steps
    (quadrature tolerance); the group replay over the run axis (momentum rows) gives member 1 the rows of its own
    replay (float32 rounding: 1e3 eps of each column's largest |value|)."""
    _, runs = sgd_group
    spec = AttributionSpec([Site(1, 5)], ["is_majority_<0>"])
    opts = dict(device="cpu", progress=False)
    kept = attribute(runs[0].dir, spec, out_dir=tmp_path / "kept", **opts)
    replayed = attribute(runs[0].dir, replace(spec, replay=True, readout=32), out_dir=tmp_path / "replayed", **opts)
    a, b = (json.loads((o / "summary.json").read_text()) for o in (kept, replayed))
    for x, y in zip(a["probes"], b["probes"]):
        for k in ("change", "momentum_direct", "momentum_pre_cached", "momentum_full", "sgd_direct", "sgd_full"):
            assert x[k] == pytest.approx(y[k], rel=1e-3, abs=1e-4 * y["R0_eval"]), k
    axis = attribute_group([r.dir for r in runs], replace(spec, replay=True, readout=32),
                           out_dirs=[tmp_path / "g0", tmp_path / "g1"], **opts)
    alone = attribute(runs[1].dir, replace(spec, readout=32), out_dir=tmp_path / "alone1", **opts)
    assert json.loads((axis[1] / "spec.json").read_text())["run_axis"] is True
    want, got = (sorted(parquet_rows(o), key=row_key) for o in (alone, axis[1]))  # the paths order rows apart
    assert {x["optimizer"] for x in want} == {"none", "sgd", "momentum"}
    assert [{**x, "value": 0, "cumulative": 0} for x in got] == [{**x, "value": 0, "cumulative": 0} for x in want]
    eps = torch.finfo(torch.float32).eps
    for col in ("value", "cumulative"):
        w = torch.tensor([x[col] for x in want], dtype=torch.float64)
        torch.testing.assert_close(torch.tensor([x[col] for x in got], dtype=torch.float64), w, rtol=0,
                                   atol=1e3 * eps * w.abs().max().item())


@pytest.mark.one_thread
def test_paper_script_smoke(tmp_path):
    """``scripts/paper_gpu.sh --smoke``: the paper scale's code path (run groups, the tracked vanilla members keeping
    the account while their group trains, report); then in another folder first with ``--no-replays`` (train and
    probe only), then again without it, which adds the tracking by replaying the members begun without it."""
    env = {**os.environ, "PYTHON": sys.executable}

    def script(work, *args):
        res = subprocess.run(["bash", str(ROOT / "scripts" / "paper_gpu.sh"), "--smoke", *args, str(tmp_path / work)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads((tmp_path / work / "data.json").read_text())

    def check(work, data, account):
        assert len(data["runs"]) == 16  # 2 tasks x 4 regimes x 2 seeds
        assert {r["regime"] for r in data["influence"]} == {"vanilla"}
        assert {(r["task"], r["seed"]) for r in data["influence"]} == {(t, s) for t in ("majority", "cond_majority")
                                                                         for s in (0, 1)}
        for d in (tmp_path / work / "runs").iterdir():
            assert (d / "group.json").exists() and (d / "DONE").exists() and (d / "probes_init").exists()
            tracked = "vanilla" in d.name
            assert (d / "account" / "final.safetensors").exists() == (account and tracked)
            if tracked:
                assert json.loads((d / "attribution" / "spec.json").read_text()).get("account", False) == account
        assert (tmp_path / work / "report.md").exists()

    check("w", script("w"), account=True)
    data = script("w2", "--no-replays")
    assert len(data["runs"]) == 16 and data["influence"] == [] and not list((tmp_path / "w2").glob("runs/*/attribution"))
    check("w2", script("w2"), account=False)


def test_paper_scale_is_eight_groups_of_ten_seeds():
    from ntpflow.experiments.toy import SCALES, run_configs
    from ntpflow.runs.group import check_group

    scale = SCALES["paper"]
    groups: dict[tuple, list] = {}
    for c in run_configs(scale):
        groups.setdefault((c.task, c.regime), []).append(c)
    assert len(groups) == 8 and all(len(g) == 10 for g in groups.values())
    for g in groups.values():
        check_group(g)
    c = run_configs(scale)[0]
    assert (c.steps, c.d_model, c.n_layer, c.n_head, c.batch_size, c.lr) == (3000, 128, 2, 4, 256, 1e-3)
    assert scale.grouped and scale.tracked == ("vanilla",)
    assert sorted((s.layer, s.pos) for s in scale.sites) == [(k, p) for k in (1, 2) for p in range(2, 20)]
