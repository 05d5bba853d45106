"""The exact account kept while training (``ntpflow.engine.exact``, ``train --account``, ``ntpflow.Account``): equal
to the replay's account, row by row and matrix by matrix (float64), for any loop (AdamW's decay, clipping, a
schedule) against torch's own calls, and read by ``attribute``/``discover`` without a replay."""

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ntpflow import GPT, Account, GPTConfig, Site, lm_loss
from ntpflow.cli import main
from ntpflow.engine.exact import ExactAccount, chunk_matrices, chunk_values
from ntpflow.engine.influence import MISMATCHES, InfluenceTracker, Probe
from ntpflow.engine.replay_account import ReplayAccount
from ntpflow.files import SimulatedKill, load_tensors
from ntpflow.replay.from_account import account_rows
from ntpflow.runs.run import Run
from ntpflow.runs.training import train_step

T, V, D = 8, 7, 16
SITES = [Site(1, 3), Site(2, 5), Site(0, 2)]
EPS64 = torch.finfo(torch.float64).eps
ROW_KEY = ("step", "layer", "pos", "feature", "feature_type", "mismatch", "component", "optimizer")
TINY_SET = ["n_layer=1", "d_model=32", "n_head=2", "steps=12", "batch_size=32", "n_train=256", "n_eval=128",
            "eval_every=6", "ckpt_every=4", "log_every=2"]


def tiny(seed=0, **kw) -> GPT:
    return GPT(GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D, **kw), seed=seed).double()


def batch(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n, T), generator=g), torch.rand(n, T, generator=g) > 0.2


def optimizer(name, model, large=False):
    """Adam, SGD or SGD with momentum; ``large``: learning rates whose steps need the composite splits."""
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=5e-2 if large else 1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.3 if large else 0.1, momentum=0.9 if name == "momentum" else 0.0)


@pytest.mark.parametrize("opt_name,kw", [("adam", {}), ("momentum", {}), ("sgd", {}), ("adam", {"myopic": "kv"}), ("adam", {"position_groups": "untied"})])
def test_in_run_account_equals_the_replay(opt_name, kw):
    """Trained once with the account, then replayed with θ* known (``InfluenceTracker.use_readout``, the same fixed
    rule): the weights are the same bits, and every row and every probe's quadratic form of the influence matrices
    agrees with the replay's rows to float64 rounding."""
    start, held = tiny(0, **kw), batch(99, 10)[0]
    steps = [batch(10 + t, 6) for t in range(4)]
    model = copy.deepcopy(start)
    account = ExactAccount(model, optimizer(opt_name, model), SITES, held, levels=(8,), pieces=())
    for tokens, mask in steps:
        account.train_step(tokens, mask)
    g = torch.Generator().manual_seed(3)
    probes = [Probe(s, f"w{j}", torch.randn(D, generator=g, dtype=torch.float64)) for j, s in enumerate(SITES)]
    tracker = InfluenceTracker(copy.deepcopy(model), probes)
    tracker.use_readout(held, levels=(8,), pieces=())
    replayed = copy.deepcopy(start)
    opt = optimizer(opt_name, replayed)
    rows = []
    for tokens, mask in steps:
        rows += tracker.track(replayed, opt, tokens, mask)
        tracker.optimizer_step(replayed, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), replayed.parameters()))
    with torch.no_grad():
        resid = model(held, return_resid=True, myopic="none")[1]
    final = {s: resid[s.layer][:, s.pos] for s in SITES}
    want = {(r["step"], r["layer"], r["pos"], r["mismatch"], r["component"], r["optimizer"]): r["value"] for r in rows
            if r["feature_type"] == -1}
    compared = 0
    for first, tensors in account.chunks:
        for p in probes:
            v = chunk_values(tensors, p.site, final[p.site], p.w[None])
            for mi, mismatch in enumerate(MISMATCHES):
                key = (first, p.site.layer, p.site.pos, mismatch)
                got = {(c, o): v["influence"][mi, j, 0].item() for j, (o, c) in enumerate(account.names)}
                got |= {("risk", "none"): v["risk"][mi, 0].item(), ("change", "none"): v["change"][mi, 0].item()}
                scale = abs(want[(*key, "risk", "none")])
                for (c, o), value in got.items():
                    assert value == pytest.approx(want[(*key, c, o)], rel=1e-9, abs=1e-12 * scale), (key, c, o)
                    compared += 1
    assert compared == len(account.chunks) * len(probes) * 2 * (len(account.names) + 2)
    for p in probes:  # the matrices: wᵀ (Σ over the chunks) w against the sum of the replay's rows
        total = sum(chunk_matrices(t, p.site, final[p.site]) for _, t in account.chunks)
        for mi, mismatch in enumerate(MISMATCHES):
            key = (p.site.layer, p.site.pos, mismatch)
            scale = abs(want[(0, *key, "risk", "none")])
            for j, (o, c) in enumerate(account.names):
                summed = sum(want[(t, *key, c, o)] for t in range(len(steps)))
                assert (p.w @ total[mi, j] @ p.w).item() == pytest.approx(summed, rel=1e-9, abs=1e-12 * scale)


def test_adamw_clipping_and_a_schedule_are_torchs_and_add_up():
    """``ntpflow.Account`` under AdamW with weight decay, clipping and a warmup-cosine LambdaLR: its weights are the
    same loop's written with torch's calls (clip_grad_norm_, AdamW, LambdaLR) to float64 rounding; with many points
    the rows (with ``decay``) add up to each chunk's exact change; the clip bit (the first steps' norms exceed it)."""
    steps, lr = 12, 3e-2

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 3)
                                                 * 0.5 * (1 + math.cos(math.pi * t / steps)))

    held = batch(99, 10)[0]
    model = tiny(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = schedule(opt)
    account = Account(model, opt, ["1:3", Site(2, 5)], held, clip=0.05, chunk_steps=5)
    account._account.rule = account._account.rule.__class__(  # many points: the residual is the rule's
        account._account.rule.tokens, account._account.rule.final_proj, None, (48,), 1e-4, 1e-6, ())
    plain = tiny(0)
    popt = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.1)
    psched = schedule(popt)
    norms = []
    for t in range(steps):
        tokens, mask = batch(10 + t, 6)
        account.step(tokens, mask)
        sched.step()
        popt.zero_grad()
        lm_loss(plain(tokens), tokens, mask).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)))
        popt.step()
        psched.step()
    assert max(norms) > 0.05  # clipping acted
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(5)
    result = account.finish({"u": ("1:3", torch.randn(D, generator=g, dtype=torch.float64)),
                             "v": (Site(2, 5), torch.randn(D, generator=g, dtype=torch.float64))})
    assert result.own == "adamw" and account.steps == steps
    for e in result.summary:
        assert abs(e["residual"]) <= 1e-8 * e["R0"], e
        assert e["adamw_decay"] != 0 and e["change"] == pytest.approx(e["R0"], rel=1e-9)  # R_H(θ_T) = 0
        parts = sum(e[f"adamw_{c}"] for c in ("direct", "pre_cached", "shared", "decay"))
        assert parts == pytest.approx(e["adamw_full"], rel=1e-12)
    assert {r["step"] for r in result.rows if r["component"] == "risk"} == {0, 5, 10}  # the chunks' first steps
    assert {r["step"] for r in result.rows if r["component"] != "risk"} == {4, 9, 11}  # their last


def test_a_step_whose_error_is_rounding_of_grown_residuals_settles_at_the_first_rule():
    """The refinement's floor follows the residuals' current size, not θ_0's alone: after the residuals grow 1000×
    (as training grows them, 40× at the toy sites by step 1400), a float32 step so small that its only error is the
    rounding of r_end − r_start settles at the first rule (it used to climb the whole ladder, 31× the points, on
    every such step)."""
    model = GPT(GPTConfig(vocab_size=V, n_ctx=T, n_layer=2, n_head=2, d_model=D), seed=0)  # float32
    account = ExactAccount(model, torch.optim.SGD(model.parameters(), lr=1e-7), SITES[:1], batch(99, 32)[0],
                           chunk_steps=1, rtol=1e-4)
    account.train_step(*batch(1, 8))  # θ_0's sizes are kept
    with torch.no_grad():
        model.wte.mul_(1000)
        model.wpe.mul_(1000)
    account._resid = None  # the next step starts from the grown residuals' own forward
    before = account.evaluations
    for t in range(3):
        account.train_step(*batch(2 + t, 8))
    assert account.evaluations - before == 3 * 2 and account.refined == 0


@pytest.mark.parametrize("opt", ["amsgrad", "l2", "nesterov"])
def test_unsupported_optimizers_are_one_line_errors(opt):
    model = tiny(0)
    made = {"amsgrad": lambda: torch.optim.Adam(model.parameters(), amsgrad=True),
            "l2": lambda: torch.optim.Adam(model.parameters(), weight_decay=0.1),
            "nesterov": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)}[opt]()
    with pytest.raises(ValueError) as err:
        Account(model, made, [Site(1, 3)], batch(0, 4)[0])
    assert "\n" not in str(err.value) and "account" in str(err.value)


# ---------------------------------------------------------------- train --account, then attribute without a replay


def train_args(out: Path, *extra: str) -> list[str]:
    return ["-q", "train", "--task", "majority", "--device", "cpu", "--out", str(out), *extra, "--set", *TINY_SET]


@pytest.fixture(scope="module")
def accounted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("acc") / "run"
    assert main(train_args(out, "--account", "1:4,1:14", "--chunks", "5")) == 0
    return out


def test_train_with_account_keeps_the_bits_and_attribute_reads_it(accounted, tmp_path, caplog):
    """The weights are plain training's bits; attribute reads the account (no replay) and its totals equal the
    replay's to float32 rounding and quadrature; a direction of one's own and discover read it too."""
    assert main(train_args(tmp_path / "plain")) == 0
    mine, plain = Run.open(accounted).weights("final"), Run.open(tmp_path / "plain").weights("final")
    assert all(torch.equal(mine[k], plain[k]) for k in plain)
    np.save(tmp_path / "w.npy", np.random.default_rng(0).standard_normal(32))
    common = ["attribute", str(accounted), "--sites", "1:4,1:14", "--features", "is_majority_<0>",
              "--direction", f"mine=1:4:{tmp_path / 'w.npy'}"]
    with caplog.at_level("INFO", logger="ntpflow"):
        assert main(["-q", *common, "--out", str(tmp_path / "kept"), "--matrices"]) == 0
    assert "kept while training: no replay" in caplog.text
    assert main(["-q", *common, "--out", str(tmp_path / "replayed"), "--replay"]) == 0
    kept, replayed = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("kept", "replayed"))
    assert kept["account"] and kept["chunk_steps"] == 3 and "account" not in replayed
    assert len(kept["probes"]) == len(replayed["probes"]) == 6
    for a, b in zip(kept["probes"], replayed["probes"]):
        assert (a["pos"], a["feature"], a["mismatch"]) == (b["pos"], b["feature"], b["mismatch"])
        for k in ("R0_eval", "change", "adam_direct", "adam_pre_cached", "adam_shared", "adam_full", "sgd_direct",
                  "sgd_shared", "sgd_full"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-4 * b["R0_eval"]), k
    assert main(["-q", "discover", str(accounted), "--site", "1:4", "--attribution", str(tmp_path / "kept"),
                 "--null", "50"]) == 0
    # without an attribution's matrices, discover reads the account's: the same directions, bit for bit
    assert main(["-q", "discover", str(accounted), "--site", "1:4", "--null", "50",
                 "--out", str(tmp_path / "direct")]) == 0
    found = [json.loads((d / "discover.json").read_text())
             for d in (tmp_path / "kept" / "discover" / "1_4", tmp_path / "direct")]
    assert found[0]["mismatches"] == found[1]["mismatches"]


def test_attribute_without_sites_reads_the_accounts_sites(accounted, tmp_path):
    """``attribute RUN`` of a run trained with ``--account 1:4,1:14`` is ``attribute RUN --sites 1:4,1:14`` (a run
    without an account still asks for sites: tests/test_own_question.py)."""
    outs = [tmp_path / "default", tmp_path / "named"]
    assert main(["-q", "attribute", str(accounted), "--out", str(outs[0])]) == 0
    assert main(["-q", "attribute", str(accounted), "--sites", "1:4,1:14", "--out", str(outs[1])]) == 0
    a, b = (json.loads((o / "spec.json").read_text()) for o in outs)
    assert a == b and a["sites"] == [[1, 4], [1, 14]]
    assert (outs[0] / "influence.parquet").read_bytes() == (outs[1] / "influence.parquet").read_bytes()


def test_interrupted_training_resumes_to_the_same_account(accounted, tmp_path, monkeypatch):
    """Killed right after a checkpoint (step 4, inside the chunk of steps 3–5), rerun: every chunk and the final
    file have the bits of the uninterrupted run's."""
    out = tmp_path / "run"
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")
    with pytest.raises(SimulatedKill):
        main(train_args(out, "--account", "1:4,1:14", "--chunks", "5"))
    monkeypatch.delenv("NTPFLOW_FAULT")
    assert main(train_args(out, "--account", "1:4,1:14", "--chunks", "5")) == 0
    ref, got = Run.open(accounted).account, Run.open(out).account
    assert [p.name for p in got.chunk_files()] == [p.name for p in ref.chunk_files()] and ref.chunk_files()
    for a, b in zip(ref.chunk_files() + [ref.final], got.chunk_files() + [got.final]):
        x, y = load_tensors(a), load_tensors(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), b.name


def test_only_the_newest_two_checkpoints_keep_the_account_state(accounted, tmp_path, monkeypatch, caplog):
    """Killed after each of the checkpoints of steps 2, 4, 6 and 8: only 6 and 8 keep the account's resume state (the
    older sidecars no longer name it). With step 8's state corrupted, the rerun falls back to step 6 and ends in the
    bits of the uninterrupted run's account (the checkpoint cadence changes no step)."""
    out, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    args = [*train_args(out, "--account", "1:4,1:14", "--chunks", "5")[:-len(TINY_SET)],
            *[a for a in TINY_SET if not a.startswith("ckpt_every=")], "ckpt_every=2"]
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")
    for _ in range(4):  # each rerun resumes and is killed after its first checkpoint
        with pytest.raises(SimulatedKill):
            main(args)
    monkeypatch.delenv("NTPFLOW_FAULT")
    assert sorted(p.name for p in ckpt.glob("*.extras.safetensors")) == [
        "step_000006.extras.safetensors", "step_000008.extras.safetensors"]
    sides = {s: json.loads((ckpt / f"step_{s:06d}.json").read_text()) for s in (2, 4, 6, 8)}
    assert [("extras_sha256" in m) for m in sides.values()] == [False, False, True, True]
    extras = ckpt / "step_000008.extras.safetensors"
    data = bytearray(extras.read_bytes())
    data[-1] ^= 1
    extras.write_bytes(bytes(data))
    assert main(args) == 0
    assert "step_000008.extras.safetensors" in caplog.text and "falling back" in caplog.text
    ref, got = Run.open(accounted).account, Run.open(out).account
    assert [p.name for p in got.chunk_files()] == [p.name for p in ref.chunk_files()]
    for a, b in zip(ref.chunk_files() + [ref.final], got.chunk_files() + [got.final]):
        x, y = load_tensors(a), load_tensors(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), b.name


@pytest.mark.parametrize("extra,fragment", [
    (["--readout", "8"], "go with --account"),
    (["--account", "3:4"], "layer"),
    (["--account", "1:4", "--readout", "1"], "--readout takes 2..128"),
])
def test_bad_account_options_are_one_line_errors_and_write_nothing(tmp_path, capsys, extra, fragment):
    assert main(train_args(tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ntpflow: error:") and fragment in err[0], err
    assert not (tmp_path / "run").exists()


def test_account_on_a_run_trained_without_it_is_refused(tmp_path, capsys):
    assert main(train_args(tmp_path / "run")) == 0
    assert main(train_args(tmp_path / "run", "--account", "1:4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained without --account" in err[0], err
    assert not (tmp_path / "run" / "account").exists()


def _worker(rank: int, size: int, init: str, out: str) -> None:
    """One of two gloo workers: the float64 account of test_two_gloo_workers_equal_one_process, written by rank 0."""
    import torch.distributed as dist

    from ntpflow.runs.workers import leave_workers

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        torch.save(_float64_account(), out) if rank == 0 else _float64_account()
    finally:
        leave_workers()  # a barrier first: a worker that leaves while the other still talks aborts


def _float64_account() -> tuple[list, list]:
    """A float64 account of 4 Adam steps at two sites, clipped, chunks of 2 steps, a typed feature: (weights,
    chunks)."""
    model = tiny(0)
    labels = {"a": torch.randint(0, 3, (10, T), generator=torch.Generator().manual_seed(7))}  # a typed feature
    account = ExactAccount(model, torch.optim.Adam(model.parameters(), lr=1e-2), SITES[:2], batch(99, 10)[0],
                           chunk_steps=2, clip=0.5, levels=(8,), pieces=(), types=labels)
    for t in range(4):
        account.train_step(*batch(10 + t, 6))
    return [p.detach().clone() for p in model.parameters()], account.chunks


def test_two_gloo_workers_equal_one_process(tmp_path):
    """Two gloo workers (each decomposes half the batch and integrates half the readout; the gradients summed, the
    accumulators summed and gathered) give one process's float64 account: weights and every chunk tensor to 1e-9."""
    import torch.multiprocessing as mp

    out = tmp_path / "two.pt"
    mp.spawn(_worker, args=(2, f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2)
    (w2, chunks2), (w1, chunks1) = torch.load(out), _float64_account()
    for a, b in zip(w2, w1):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert [f for f, _ in chunks2] == [f for f, _ in chunks1] == [0, 2]
    for (_, x), (_, y) in zip(chunks2, chunks1):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=1e-9, atol=1e-12 * float(y[k].abs().max()), msg=k)


def test_train_with_two_workers_writes_the_run(accounted, tmp_path, capfd):
    """train --workers 2 (two processes started by ntpflow, gloo) writes the run one process writes: the same chunks
    and files, worker 0 alone reporting; its values are one process's up to float32 rounding, which Adam's
    per-parameter normalization lifts to ~lr on entries whose gradient is near zero (the exact equality is the
    float64 test above)."""
    out = tmp_path / "two"
    assert main(train_args(out, "--account", "1:4,1:14", "--chunks", "5", "--workers", "2")) == 0
    assert capfd.readouterr().out.strip().splitlines() == [str(out)]  # worker 0 alone reports
    one, two = Run.open(accounted), Run.open(out)
    lr = one.cfg.lr
    for k, v in one.weights("final").items():
        torch.testing.assert_close(two.weights("final")[k], v, rtol=0, atol=lr)
    assert [p.name for p in two.account.chunk_files()] == [p.name for p in one.account.chunk_files()]
    assert json.loads((out / "DONE").read_text())["step"] == 12
    assert main(["-q", "attribute", str(out), "--sites", "1:4", "--features", "is_majority_<0>"]) == 0
    assert json.loads((out / "attribution" / "summary.json").read_text())["account"]


def test_workers_need_the_account(tmp_path, capsys):
    assert main(train_args(tmp_path / "run", "--workers", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--account" in err[0], err
    assert not (tmp_path / "run").exists()


OTHELLO_SET = ["board_size=6", "n_layer=1", "d_model=32", "n_head=2", "steps=6", "batch_size=16", "n_train=128",
               "n_eval=64", "eval_every=6", "ckpt_every=6", "log_every=2"]


def othello_args(out: Path, *extra: str) -> list[str]:
    return ["-q", "train", "--task", "othello", "--device", "cpu", "--out", str(out), *extra, "--set", *OTHELLO_SET]


def test_a_typed_task_keeps_per_type_rows_or_is_replayed(tmp_path, caplog):
    """Othello's squares are typed (empty / NTP-useless / NTP-useful per example). An account without
    --account-types has no per-type rows: attribute says so and replays. With --account-types sq_C3, attribute reads
    the account, and its per-type totals are the replay's to float32 rounding and quadrature."""
    import pyarrow.parquet as pq

    def totals(folder: Path) -> dict:
        t = pq.read_table(folder / "influence.parquet").to_pylist()
        last = max(r["step"] for r in t)
        return {(r["pos"], r["feature_type"], r["mismatch"], r["component"], r["optimizer"]): r["cumulative"]
                for r in t if r["component"] != "risk" and r["step"] == last}

    plain = tmp_path / "plain"
    assert main(othello_args(plain, "--account", "1:5")) == 0
    with caplog.at_level("INFO", logger="ntpflow"):
        assert main(["-q", "attribute", str(plain), "--sites", "1:5", "--features", "sq_C3"]) == 0
    assert "keeps no per-type rows of sq_C3" in caplog.text
    typed = tmp_path / "typed"
    assert main(othello_args(typed, "--account", "1:5", "--account-types", "sq_C3")) == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="ntpflow"):
        assert main(["-q", "attribute", str(typed), "--sites", "1:5", "--features", "sq_C3"]) == 0
        assert main(["-q", "attribute", str(typed), "--sites", "1:5", "--features", "sq_C3", "--replay",
                     "--out", str(tmp_path / "replayed")]) == 0
    assert caplog.text.count("kept while training: no replay") == 1
    kept, replayed = totals(typed / "attribution"), totals(tmp_path / "replayed")
    assert {k[1] for k in kept} == {k[1] for k in replayed} and len({k[1] for k in kept}) > 1
    assert kept.keys() == replayed.keys()
    for k, v in replayed.items():
        assert kept[k] == pytest.approx(v, rel=1e-3, abs=1e-5), k


def test_bad_account_types_are_one_line_errors(tmp_path, capsys):
    assert main(othello_args(tmp_path / "a", "--account", "1:5", "--account-types", "sq_Z9")) == 2
    assert main(train_args(tmp_path / "b", "--account", "1:4", "--account-types", "is_majority_<0>")) == 2
    assert main(train_args(tmp_path / "c", "--account-types", "x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "unknown feature" in err[0] and "labels no feature by type" in err[1], err
    assert "go" in err[2] and not any((tmp_path / d).exists() for d in "abc")


def test_loss_parts_sum_to_the_batch_loss():
    """lm_loss_part of a batch's parts, weighted by position_weights of the whole batch, sums to its lm_loss (float64),
    also where a position counts in one part only or in none."""
    from ntpflow.model.loss import lm_loss_part, position_weights

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, T, V, generator=g, dtype=torch.float64)
    tokens, mask = batch(1, 6)
    mask[:3, 2] = False  # position 2 counts in the second part only
    mask[:, 4] = False  # position 4 counts nowhere
    for m in (mask, None):
        w = position_weights(tokens, m)
        parts = sum(lm_loss_part(logits[r], tokens[r], None if m is None else m[r], w)
                    for r in (slice(0, 3), slice(3, 6)))
        assert float(parts) == pytest.approx(float(lm_loss(logits, tokens, m)), rel=1e-13)


def test_type_subsets_equal_the_replays():
    """With type labels on the readout (Othello's squares are typed so), the account's per-type rows equal the
    replay's (``use_readout(types=...)``) to float64 rounding, every type present at each site's position."""
    start, held = tiny(0), batch(99, 12)[0]
    g = torch.Generator().manual_seed(7)
    labels = {"a": torch.randint(0, 3, (12, T), generator=g), "b": torch.randint(0, 2, (12, T), generator=g)}
    steps = [batch(10 + t, 6) for t in range(3)]
    model = copy.deepcopy(start)
    account = ExactAccount(model, optimizer("adam", model), SITES[:2], held, levels=(8,), pieces=(), types=labels)
    for tokens, mask in steps:
        account.train_step(tokens, mask)
    probes = [Probe(s, name, torch.randn(D, generator=g, dtype=torch.float64)) for s in SITES[:2] for name in "ab"]
    tracker = InfluenceTracker(copy.deepcopy(model), probes)
    tracker.use_readout(held, types=labels, levels=(8,), pieces=())
    replayed = copy.deepcopy(start)
    opt = optimizer("adam", replayed)
    want = {}
    for tokens, mask in steps:
        for r in tracker.track(replayed, opt, tokens, mask):
            want[(r["step"], r["layer"], r["pos"], r["feature"], r["feature_type"], r["mismatch"], r["component"],
                  r["optimizer"])] = r["value"]
        tracker.optimizer_step(replayed, opt)
    with torch.no_grad():
        resid = model(held, return_resid=True, myopic="none")[1]
    final = {s: resid[s.layer][:, s.pos] for s in SITES[:2]}
    got = account_rows(account.chunks, final, account.own, account.names, probes, labels)
    typed = [r for r in got if r["feature_type"] >= 0]
    assert {r["feature_type"] for r in typed} == {0, 1, 2} and len(typed) > len(got) / 2
    for r in got:
        key = (r["step"], r["layer"], r["pos"], r["feature"], r["feature_type"], r["mismatch"], r["component"],
               r["optimizer"])
        scale = abs(want[(*key[:6], "risk", "none")])
        assert r["value"] == pytest.approx(want[key], rel=1e-9, abs=1e-12 * scale), key


def test_train_with_workers_rebuilds_the_config_and_writes_the_run(accounted, tmp_path):
    """``train_with_workers`` (what reproduce uses on several GPUs) starts ``ntpflow train --workers``: the workers
    rebuild the caller's config from its overrides (the same hash) and write the run that ``--workers 2`` writes."""
    from ntpflow.experiments.parallel import train_with_workers
    from ntpflow.model.sites import parse_sites
    from ntpflow.runs.account import AccountSpec
    from ntpflow.runs.config import config_from

    one = Run.open(accounted)
    run = train_with_workers(one.cfg, tmp_path / "two", AccountSpec(tuple(parse_sites("1:4,1:14")), chunks=5), 2)
    assert run.cfg.hash() == one.cfg.hash() and config_from(one.cfg.overrides()) == one.cfg
    assert [p.name for p in run.account.chunk_files()] == [p.name for p in one.account.chunk_files()]
    for k, v in one.weights("final").items():
        torch.testing.assert_close(run.weights("final")[k], v, rtol=0, atol=one.cfg.lr)
    with pytest.raises(ValueError, match="keeps the SGD-direction rows"):
        AccountSpec(tuple(parse_sites("1:4")), sgd_rows=False).cli_args()


def test_jobs_take_the_gpus_in_turn():
    from ntpflow.experiments.parallel import job_devices

    assert job_devices("cuda", 5, gpus=2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert job_devices("cpu", 3) == ["cpu"] * 3
    assert job_devices("cuda:1", 2, gpus=1) == ["cuda:1"] * 2


def trained(opt_name, steps):
    """θ* of ``steps`` training steps from ``tiny(0)``."""
    model = tiny(0)
    opt = optimizer(opt_name, model, large=True)
    for tokens, mask in steps:
        train_step(model, opt, tokens, mask)
    return model


@pytest.mark.parametrize("opt_name", ["adam", "momentum", "sgd"])
def test_replay_account_settles_as_the_tracker_and_gives_its_rows(opt_name):
    """The replay's account (``ReplayAccount``, what ``attribute`` runs) judges each step by the probes' risks as the
    tracker's exact reading does: large steps that reach the composite splits, type subsets; the same bits, the same
    rule at every step (the counters), every row within 1e-9 of its probe's largest row at that step (the account
    contracts ⟨w, ṙ⟩ with ⟨w, r⟩ and ⟨w, r*⟩ apart, the tracker with their difference)."""
    steps = [batch(10 + t, 6) for t in range(6)]
    held = batch(99, 12)[0]
    g = torch.Generator().manual_seed(7)
    labels = {"a": torch.randint(0, 3, (12, T), generator=g)}
    final_model = trained(opt_name, steps)
    probes = [Probe(s, name, torch.randn(D, generator=g, dtype=torch.float64)) for s in SITES for name in "ab"]
    tracker = InfluenceTracker(copy.deepcopy(final_model), probes)
    tracker.use_readout(held, types=labels)
    model = tiny(0)
    opt = optimizer(opt_name, model, large=True)
    want = {}
    for tokens, mask in steps:
        for r in tracker.track(model, opt, tokens, mask):
            want[tuple(r[k] for k in ROW_KEY)] = r["value"]
        tracker.optimizer_step(model, opt)
    with torch.no_grad():
        resid = final_model(held, return_resid=True, myopic="none")[1]
    final = {s: resid[s.layer][:, s.pos] for s in SITES}
    model = tiny(0)
    account = ReplayAccount(model, optimizer(opt_name, model, large=True), probes, held, final, types=labels)
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
        key = tuple(r[k] for k in ROW_KEY)
        assert r["value"] == pytest.approx(want[key], rel=0, abs=1e-9 * scale[key[:4]]), key
