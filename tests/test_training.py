"""Training loop, run directories, resuming, data order, evaluation and config overrides."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ntpflow import GPT, TrainConfig, apply_overrides
from ntpflow.files import SimulatedKill
from ntpflow.runs.data import DataOrder, make_datasets, to_torch
from ntpflow.runs.run import Run, model_config
from ntpflow.runs.training import evaluate, train
from ntpflow.tasks import make_task

TINY = TrainConfig(n_layer=1, d_model=32, n_head=2, steps=12, batch_size=32, n_train=256, n_eval=128,
                   eval_every=6, ckpt_every=4, log_every=2, device="cpu")


def snapshot(d: Path) -> dict:
    """Bytes and mtime of every file under ``d`` (to check that nothing was touched)."""
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


def assert_same_final_state(d: Path, ref: Path):
    """The final weights and optimizer state of run folders ``d`` and ``ref`` are bit-identical."""
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert_same_tensors(load_file(d / name), load_file(ref / name))


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert x.dtype == b[k].dtype and x.shape == b[k].shape, k
        assert torch.equal(x, b[k]), k


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Run:
    return train(TINY, tmp_path_factory.mktemp("tiny") / "run", progress=False)


# ---------------------------------------------------------------- determinism


def test_same_seed_bit_identical_and_other_seed_differs(tmp_path, tiny_run):
    again = train(TINY, tmp_path / "again", progress=False)
    a = load_file(tiny_run.dir / "model.safetensors")
    b = load_file(again.dir / "model.safetensors")
    assert not any(k.startswith(("adam.", "model.")) for k in a)  # the weights alone, by parameter name
    assert any(k.startswith("adam.") for k in load_file(tiny_run.dir / "optimizer.safetensors"))
    assert_same_tensors(a, b)
    assert_same_tensors(load_file(tiny_run.dir / "optimizer.safetensors"), load_file(again.dir / "optimizer.safetensors"))
    assert tiny_run.metrics() == again.metrics()

    other = train(replace(TINY, seed=1), tmp_path / "seed1", progress=False)
    c = load_file(other.dir / "model.safetensors")
    assert a.keys() == c.keys()
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert not torch.equal(a["wte"], c["wte"])


@pytest.mark.parametrize("split_at", [0, 7], ids=["untied", "split"])
def test_untied_training_bit_identical(tmp_path, split_at):
    # big enough batches that CPU kernels run multi-threaded, where a scatter-add backward would be racy
    cfg = replace(TINY, regime="untied", split_at=split_at, batch_size=256, n_train=512, steps=3, ckpt_every=3)
    a = load_file(train(cfg, tmp_path / "a", progress=False).dir / "model.safetensors")
    b = load_file(train(cfg, tmp_path / "b", progress=False).dir / "model.safetensors")
    assert_same_tensors(a, b)


# ---------------------------------------------------------------- resuming


# One thread per process: the two runs below train concurrently on a small machine (and the same env everywhere).
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _cli_cmd(out: Path) -> list[str]:
    sets = ["n_layer=1", "d_model=32", "n_head=2", "steps=100", "batch_size=32", "n_train=256", "n_eval=128",
            "eval_every=10", "ckpt_every=5", "log_every=1"]
    return [sys.executable, "-m", "ntpflow", "-q", "train", "--task", "majority", "--regime", "vanilla",
            "--seed", "3", "--device", "cpu", "--out", str(out), "--set", *sets]


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    quiet = {"cwd": tmp_path, "capture_output": True, "text": True, "timeout": 120, "check": False}
    # SIGKILL right after the first checkpoint is saved, at a named point (deterministic, no timing)
    proc = subprocess.run(_cli_cmd(killed_dir), env={**_ENV, "NTPFLOW_FAULT": "train:after_checkpoint:kill"}, **quiet)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ref = subprocess.run(_cli_cmd(ref_dir), env=_ENV, **quiet)
    assert ref.returncode == 0, ref.stderr

    # The kill came mid-run.
    assert not (killed_dir / "DONE").exists()
    assert not (killed_dir / "model.safetensors").exists()
    killed = Run.open(killed_dir)
    assert killed.checkpoints() and max(killed.checkpoints()) < killed.cfg.steps

    done = subprocess.run(_cli_cmd(killed_dir), check=False, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=_ENV)
    assert done.returncode == 0, done.stderr
    assert (killed_dir / "DONE").exists()

    assert_same_final_state(killed_dir, ref_dir)
    assert_same_tensors(load_file(killed_dir / "init.safetensors"), load_file(ref_dir / "init.safetensors"))

    resumed, uninterrupted = Run.open(killed_dir).metrics(), Run.open(ref_dir).metrics()
    keys = [(m["step"], m["kind"]) for m in resumed]
    assert len(keys) == len(set(keys)), "duplicate (step, kind) records"
    assert resumed == uninterrupted  # same records, same order, float-identical values
    assert len(uninterrupted) == 100 + 11  # 100 train records (log_every=1), evals at 0, 10, ..., 100


@pytest.fixture(scope="module")
def ckpt3_run(tmp_path_factory) -> Run:
    # checkpoints at 3, 6, 9; the checkpoint interval does not change results
    return train(replace(TINY, ckpt_every=3), tmp_path_factory.mktemp("ckpt3") / "run", progress=False)


@pytest.mark.parametrize("resume_from", [3, 6])
def test_resume_truncates_metrics_written_after_last_checkpoint(tmp_path, tiny_run, ckpt3_run, resume_from):
    """A run killed after its checkpoint at ``resume_from`` but after logging up to the end (and half a line)
    resumes to exactly the records of the uninterrupted run. Step 6 has a train and an eval record."""
    d = tmp_path / "run"
    shutil.copytree(ckpt3_run.dir, d)
    full_metrics = (d / "metrics.jsonl").read_text()
    for name in ["DONE", "model.safetensors", "model.json"] + [
            f"ckpt/step_{s:06d}.{ext}" for s in (3, 6, 9) if s > resume_from for ext in ("safetensors", "json")]:
        (d / name).unlink()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "kind": "tra')  # a line cut by the kill
    assert Run.open(d).checkpoints()[-1] == resume_from
    train(ckpt3_run.cfg, d, progress=False)
    assert (d / "metrics.jsonl").read_text() == full_metrics
    assert Run.open(d).metrics() == tiny_run.metrics()
    assert_same_final_state(d, tiny_run.dir)


def test_incomplete_checkpoint_without_sidecar_is_ignored(tmp_path, tiny_run):
    d = tmp_path / "run"
    shutil.copytree(tiny_run.dir, d)
    for name in ("DONE", "model.safetensors", "model.json", "ckpt/step_000008.json"):
        (d / name).unlink()
    (d / "ckpt" / "step_000008.safetensors").write_bytes(b"garbage")  # killed before its sidecar was written
    assert Run.open(d).checkpoints() == [4]
    train(TINY, d, progress=False)
    assert_same_final_state(d, tiny_run.dir)


def test_finished_run_is_not_touched_again(tmp_path, tiny_run):
    d = tmp_path / "run"
    shutil.copytree(tiny_run.dir, d)
    before = snapshot(d)
    run = train(replace(TINY, log_every=3), d, progress=False)  # log_every does not change results
    assert run.done
    assert snapshot(d) == before


def test_resume_with_different_config_raises_and_leaves_files(tmp_path, tiny_run):
    d = tmp_path / "run"
    shutil.copytree(tiny_run.dir, d)
    (d / "DONE").unlink()  # also an unfinished run must be protected
    before = snapshot(d)
    for change in ({"steps": 11}, {"lr": 3e-3}, {"regime": "myopic"}, {"seed": 1}, {"ckpt_every": 3}):
        with pytest.raises(ValueError, match="different config") as e:
            train(replace(TINY, **change), d, progress=False)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.split("differs in: ")[1].split(")")[0] == next(iter(change))
        assert snapshot(d) == before


@pytest.mark.parametrize("fault", [None, "extend:before_config"])
def test_more_steps_extend_a_run_to_the_bits_of_a_longer_run(tmp_path, tiny_run, fault, monkeypatch):
    longer = replace(TINY, steps=20)
    straight = train(longer, tmp_path / "straight", progress=False)
    d = tmp_path / "extended"
    shutil.copytree(tiny_run.dir, d)
    (d / "probes").mkdir()  # probes of the 12-step weights are kept as the probes of checkpoint 12
    if fault:
        monkeypatch.setenv("NTPFLOW_FAULT", fault)
        with pytest.raises(SimulatedKill):
            train(longer, d, progress=False)
        monkeypatch.delenv("NTPFLOW_FAULT")
    run = train(longer, d, progress=False)
    assert run.done and run.cfg == longer and Run.open(d).cfg == longer
    # exact: the same ops in one process (no schedule, so steps 12..20 continue the 12-step run)
    assert_same_final_state(d, straight.dir)
    assert run.metrics() == straight.metrics()
    assert (d / "probes_12").is_dir() and not (d / "probes").exists()
    assert (d / "ckpt" / "step_000012.json").exists()
    assert json.loads((d / "env.json").read_text())["extensions"][0]["to_steps"] == 20


def test_a_replayed_run_is_not_extended(tmp_path, tiny_run):
    d = tmp_path / "run"
    shutil.copytree(tiny_run.dir, d)
    (d / "attribution").mkdir()
    before = snapshot(d)
    with pytest.raises(ValueError, match="move it away") as e:
        train(replace(TINY, steps=20), d, progress=False)
    assert "\n" not in str(e.value)
    assert snapshot(d) == before


# ---------------------------------------------------------------- loading


def test_missing_or_corrupted_checkpoint_one_line_errors(tmp_path, tiny_run):
    d = tmp_path / "run"
    shutil.copytree(tiny_run.dir, d)
    run = Run.open(d)
    assert run.checkpoints() == [4, 8]
    assert_same_tensors(run.load_model(4).state_dict(), load_file(d / "ckpt/step_000004.safetensors"))

    with pytest.raises(FileNotFoundError) as e:
        run.load_model(5)
    assert "\n" not in str(e.value) and "step_000005" in str(e.value)

    path = d / "ckpt" / "step_000004.safetensors"
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 1, 4):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError) as e:
            run.load_model(4)
        assert "\n" not in str(e.value) and str(path) in str(e.value)

    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as e:
        run.load_model("final")
    assert "\n" not in str(e.value)

    with pytest.raises(ValueError, match="unknown weights") as e:
        run.load_model("latest")
    assert "\n" not in str(e.value)


def test_checkpoint_of_another_model_is_a_one_line_error(tmp_path, tiny_run):
    other = train(replace(TINY, d_model=16, steps=2), tmp_path / "small", progress=False)
    (tmp_path / "copy").mkdir()
    run = Run(tmp_path / "copy", TINY)
    (run.dir / "model.safetensors").write_bytes((other.dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="does not match") as e:
        run.load_model("final")
    assert "\n" not in str(e.value)


def test_open_non_run_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        Run.open(tmp_path)


# ---------------------------------------------------------------- run directory


def test_run_dir_contents(tiny_run):
    d, cfg, task = tiny_run.dir, TINY, make_task(TINY.task)
    saved = json.loads((d / "config.json").read_text())
    assert TrainConfig.from_dict(saved["train"]) == cfg
    assert saved["config_hash"] == cfg.hash()
    assert saved["model"] == model_config(cfg, task).to_dict()
    assert Run.open(d).cfg == cfg

    env = json.loads((d / "env.json").read_text())
    assert env["torch"] == torch.__version__
    assert "git_commit" in env
    assert env["git_commit"] is None or (len(env["git_commit"]) == 40 and int(env["git_commit"], 16) >= 0)

    init, final = load_file(d / "init.safetensors"), load_file(d / "model.safetensors")
    fresh = GPT(model_config(cfg, task), seed=cfg.seed).state_dict()
    assert_same_tensors(init, {f"model.{k}": v for k, v in fresh.items()})
    assert {f"model.{k}" for k in final} == init.keys()  # init.safetensors: as older versions name them
    changed = [k for k in init if not torch.equal(init[k], final[k.removeprefix("model.")])]
    assert "model.wte" in changed and len(changed) == len(init)  # every parameter gets gradient and moves
    assert_same_tensors(tiny_run.load_model("init").state_dict(), fresh)
    assert_same_tensors(tiny_run.load_model("final").state_dict(), final)

    assert json.loads((d / "init.json").read_text())["step"] == 0
    sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # verified on every load
    opt_sha = hashlib.sha256((d / "optimizer.safetensors").read_bytes()).hexdigest()
    assert json.loads((d / "model.json").read_text()) == {"step": 12, "adam_step": 12, "config_hash": cfg.hash(),
                                                          "sha256": sha, "optimizer_sha256": opt_sha}
    assert json.loads((d / "ckpt/step_000008.json").read_text())["adam_step"] == 8
    assert tiny_run.checkpoints() == [4, 8]  # none at the last step: the final weights are model.safetensors

    metrics = tiny_run.metrics()
    assert [(m["step"], m["kind"]) for m in metrics] == [
        (0, "eval"), (2, "train"), (4, "train"), (6, "train"), (6, "eval"), (8, "train"), (10, "train"),
        (12, "train"), (12, "eval")]  # the train record of step s (after s updates) precedes the eval at s
    done = json.loads((d / "DONE").read_text())
    assert done == {"step": 12, **{k: v for k, v in metrics[-1].items() if k not in ("step", "kind")}}
    assert 0 <= done["legal_acc"] <= 1 and 0 <= done["first_acc"] <= 1 and done["eval_loss"] > 0
    assert metrics[-1]["eval_loss"] < metrics[0]["eval_loss"]  # 12 Adam steps at lr 1e-3 do learn something


def test_final_eval_record_matches_evaluate_of_final_model(tiny_run):
    task = tiny_run.task
    _, eval_set = make_datasets(TINY, task)
    got = evaluate(tiny_run.load_model("final"), to_torch(eval_set, "cpu"), task)
    assert got == {k: v for k, v in tiny_run.metrics()[-1].items() if k not in ("step", "kind")}


def test_make_datasets_depend_on_data_seed_only():
    task = make_task("majority")
    tr, ev = make_datasets(replace(TINY, n_train=64, n_eval=32), task)
    assert tr.tokens.shape == (64, task.seq_len) and ev.tokens.shape == (32, task.seq_len)
    assert not np.array_equal(tr.tokens[:32], ev.tokens)
    tr2, ev2 = make_datasets(replace(TINY, n_train=64, n_eval=32, seed=5, data_seed=0), task)
    assert np.array_equal(tr.tokens, tr2.tokens) and np.array_equal(ev.tokens, ev2.tokens)
    tr3, _ = make_datasets(replace(TINY, n_train=64, n_eval=32, data_seed=1), task)
    assert not np.array_equal(tr.tokens, tr3.tokens)


# ---------------------------------------------------------------- data order


@pytest.mark.parametrize("n_train,bs", [(256, 32), (100, 32), (7, 7)])
def test_data_order_epochs_are_permutations(n_train, bs):
    order = DataOrder(seed=0, n_train=n_train, batch_size=bs)
    per_epoch = n_train // bs
    epochs = []
    for epoch in range(3):
        batches = [order(epoch * per_epoch + i) for i in range(per_epoch)]
        assert all(b.shape == (bs,) and b.dtype == torch.long for b in batches)
        idx = torch.cat(batches).tolist()
        assert len(set(idx)) == per_epoch * bs  # no repeats within an epoch
        assert set(idx) <= set(range(n_train))
        if per_epoch * bs == n_train:
            assert sorted(idx) == list(range(n_train))
        epochs.append(idx)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_data_order_batches_differ_and_are_recomputable():
    order = DataOrder(seed=0, n_train=256, batch_size=32)
    first = order(0).clone()
    assert not torch.equal(first, order(8))  # step 0 of epoch 0 vs epoch 1
    assert not torch.equal(first, order(1))
    s5 = order(5).clone()
    for step in (40, 17, 3, 100):
        order(step)
    assert torch.equal(order(5), s5)
    assert torch.equal(order(0), first)
    fresh = DataOrder(seed=0, n_train=256, batch_size=32)
    assert torch.equal(fresh(100), order(100))
    assert torch.equal(fresh(5), s5)
    assert not torch.equal(DataOrder(seed=1, n_train=256, batch_size=32)(5), s5)


# ---------------------------------------------------------------- evaluate


class FixedLogits(torch.nn.Module):
    """Returns the rows of precomputed logits in the order it is called (checks it gets the right tokens)."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor):
        super().__init__()
        self.logits, self.tokens, self.i = logits, tokens, 0
        self.modes = []

    def forward(self, tok):
        self.modes.append(self.training)
        n = len(tok)
        assert torch.equal(tok, self.tokens[self.i:self.i + n])
        out = self.logits[self.i:self.i + n]
        self.i += n
        return out


def _reference_eval(logits: np.ndarray, batch) -> dict:
    """Direct loops: mean over examples of the fraction of legal argmaxes at p0..T-2; legal argmax at p0; loss."""
    task = make_task("majority")
    p0, T = task.first_output_pos, task.seq_len
    n = len(batch)
    legal_frac, first = [], []
    for b in range(n):
        hits = [bool(batch.legal[b, p, int(np.argmax(logits[b, p]))]) for p in range(p0, T - 1)]
        legal_frac.append(sum(hits) / len(hits))
        first.append(hits[0])
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    per_pos = []
    for p in range(T - 1):
        rows = [b for b in range(n) if batch.loss_mask[b, p]]
        if rows:
            per_pos.append(np.mean([lse[b, p] - logits[b, p, batch.tokens[b, p + 1]] for b in rows]))
    return {"eval_loss": float(np.mean(per_pos)), "legal_acc": float(np.mean(legal_frac)),
            "first_acc": float(np.mean(first))}


@pytest.mark.parametrize("chunk", [2048, 25])
def test_evaluate_against_direct_recomputation(chunk):
    task = make_task("majority")
    batch = task.sample(100, np.random.default_rng(0))
    data = to_torch(batch, "cpu")
    V = len(task.vocab)
    g = torch.Generator().manual_seed(0)
    cases = {
        "random": torch.randn(100, task.seq_len, V, generator=g),
        "perfect": data["legal"].float() * 5 + torch.rand(100, task.seq_len, V, generator=g),
        "always_wrong": (~data["legal"]).float() * 5 + torch.rand(100, task.seq_len, V, generator=g),
    }
    for name, logits in cases.items():
        model = FixedLogits(logits, data["tokens"]).train()
        got = evaluate(model, data, task, chunk=chunk)
        ref = _reference_eval(logits.numpy(), batch)
        assert model.i == 100 and model.training and not any(model.modes), name
        assert got["legal_acc"] == pytest.approx(ref["legal_acc"], abs=1e-6), name  # float32 sums
        assert got["first_acc"] == pytest.approx(ref["first_acc"], abs=1e-6), name
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), name
    assert evaluate(FixedLogits(cases["perfect"], data["tokens"]), data, task)["legal_acc"] == 1.0
    wrong = evaluate(FixedLogits(cases["always_wrong"], data["tokens"]), data, task)
    assert wrong["legal_acc"] == 0.0 and wrong["first_acc"] == 0.0  # exact: a count of zero correct predictions
    assert 0 < _reference_eval(cases["random"].numpy(), batch)["legal_acc"] < 1  # the random case is non-trivial


def test_evaluate_first_acc_counts_only_the_first_output():
    task = make_task("majority")
    batch = task.sample(10, np.random.default_rng(1))
    data = to_torch(batch, "cpu")
    p0 = task.first_output_pos
    logits = data["legal"].float() * 5  # all legal ...
    logits[:4, p0] = (~data["legal"][:4, p0]).float() * 5  # ... except the first output of 4 examples
    got = evaluate(FixedLogits(logits, data["tokens"]), data, task)
    n_out = task.seq_len - 1 - p0
    assert got["first_acc"] == pytest.approx(0.6)
    assert got["legal_acc"] == pytest.approx(1 - 0.4 / n_out)


# ---------------------------------------------------------------- regimes


def test_regimes_map_to_model_configs():
    task = make_task("majority")
    T = task.seq_len

    def mc(**kw):
        return model_config(replace(TINY, **kw), task)

    van = mc(regime="vanilla")
    assert van.myopic == "none" and van.position_groups is None and van.n_groups == 1
    assert (van.vocab_size, van.n_ctx, van.n_layer, van.n_head, van.d_model) == (len(task.vocab), T, 1, 2, 32)
    assert mc(regime="myopic").myopic == "kv" and mc(regime="myopic").position_groups is None
    assert mc(regime="myopic", myopic_mode="resid").myopic == "resid"
    assert mc(regime="vanilla", myopic_mode="resid").myopic == "none"
    unt = mc(regime="untied")
    assert unt.myopic == "none" and unt.groups == (0,) * 10 + (1,) * (T - 10)
    assert mc(regime="untied", split_at=3).groups == (0,) * 3 + (1,) * (T - 3)
    full = mc(regime="untied", split_at=0)
    assert full.position_groups == "untied" and full.groups == tuple(range(T))
    both = mc(regime="myopic-untied", myopic_mode="resid")
    assert both.myopic == "resid" and both.n_groups == 2
    assert mc(regime="vanilla", split_at=0).position_groups is None
    with pytest.raises(ValueError, match="split index"):
        mc(regime="untied", split_at=T)


def test_untied_training_run(tmp_path):
    run = train(replace(TINY, regime="myopic-untied", steps=4, ckpt_every=2), tmp_path / "run", progress=False)
    model = run.load_model()
    assert model.cfg.n_groups == 2 and model.cfg.myopic == "kv"
    final = load_file(run.dir / "model.safetensors")
    assert final["wte"].shape[0] == 2
    assert not torch.equal(final["wte"][0], final["wte"][1])  # the groups were trained apart


# ---------------------------------------------------------------- overrides


def test_apply_overrides_types():
    cfg = apply_overrides(TrainConfig(), ["lr=1", "steps=7", "regime=myopic", "data_seed=3", "device=cuda:1",
                                          "task='cond_majority'", "adam_eps=1e-6"])
    assert cfg.lr == 1.0 and type(cfg.lr) is float
    assert cfg.steps == 7 and type(cfg.steps) is int
    assert cfg.regime == "myopic" and cfg.myopic == "kv"
    assert cfg.data_seed == 3 and cfg.device == "cuda:1" and cfg.task == "cond_majority" and cfg.adam_eps == 1e-6
    assert apply_overrides(cfg, ["data_seed=None"]).data_seed is None
    assert apply_overrides(cfg, [" seed = 4 "]).seed == 4
    assert apply_overrides(cfg, []) == cfg
    assert TrainConfig().lr == 1e-3  # the original is not modified (frozen)
    assert apply_overrides(TrainConfig(), ["regime=myopic-untied"]).untied


@pytest.mark.parametrize("item,match", [
    ("nokey=1", "unknown config key"),
    ("steps", "key=value"),
    ("steps=abc", "bad value"),
    ("steps=1.5", "bad value"),
    ("steps=True", "bad value"),
    ("lr=fast", "bad value"),
    ("lr=True", "bad value"),
    ("seed=None", "bad value"),
    ("regime=3", "bad value"),
    ("regime=sideways", "unknown regime"),
    ("task=nope", "unknown task"),
    ("steps=0", "steps must be positive"),
    ("lr=-1", "lr must be positive"),
    ("batch_size=1000", "exceeds n_train"),
])
def test_apply_overrides_errors(item, match):
    with pytest.raises(ValueError, match=match):
        apply_overrides(replace(TINY), [item])


def test_config_hash_ignores_device_and_logging_only():
    assert TINY.hash() == replace(TINY, device="cuda", log_every=1).hash()
    assert TINY.hash() != replace(TINY, lr=2e-3).hash()
    assert TINY.hash() != replace(TINY, data_seed=0).hash()
    with pytest.raises(ValueError, match="unknown config key"):
        TrainConfig.from_dict({**TINY.to_dict(), "bogus": 1})


def test_concurrent_writers_of_one_run_dir_are_refused(tmp_path):
    import platform

    from ntpflow.files import DirLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with DirLock(run_dir):
        with pytest.raises(RuntimeError, match="in use by another process"):
            train(TINY, run_dir, progress=False)
    assert not (run_dir / "DONE").exists() and not (run_dir / ".lock").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (run_dir / ".lock").write_text(json.dumps({"host": platform.node(), "pid": int(dead.stdout)}))
    assert train(TINY, run_dir, progress=False).done  # a stale lock (its process is gone) is taken over
    assert not (run_dir / ".lock").exists()


def test_disk_full_leaves_earlier_result_intact(tmp_path, monkeypatch):
    import errno

    from ntpflow.files import write_json

    path = tmp_path / "result.json"
    write_json(path, {"v": 1})

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"cannot write {path}: No space left on device"):
        write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no half-written temporary file


def test_tracking_sinks_get_every_metric_record(tmp_path):
    class Recorder:
        def __init__(self):
            self.records, self.closed = [], False

        def log(self, record):
            self.records.append(record)

        def close(self):
            self.closed = True

    rec = Recorder()
    run = train(TINY, tmp_path / "run", progress=False, track=[rec])
    assert rec.records == run.metrics() and rec.closed
    with pytest.raises(ValueError, match="unknown tracking sink"):
        train(TINY, tmp_path / "other", progress=False, track=["mlflow"])


def test_tensorboard_sink_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    run = train(TINY, tmp_path / "run", progress=False, track=["tensorboard"])
    assert list((run.dir / "tensorboard").glob("events.out.tfevents.*"))
