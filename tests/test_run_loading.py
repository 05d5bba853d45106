"""Run folders others can load: weights alone in model.safetensors, the optimizer state beside it, and
``GPT.from_pretrained`` on a run, a GPT-2 folder or anything else answering in one line."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ntpflow import GPT, GPTConfig, TrainConfig, train
from ntpflow.files import save_tensors
from ntpflow.runs.run import Run, read_state

TINY = TrainConfig(task="majority", n_layer=1, d_model=32, n_head=2, steps=6, batch_size=32, n_train=256, n_eval=128,
                   eval_every=3, ckpt_every=3, log_every=3, device="cpu")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    return train(TINY, tmp_path_factory.mktemp("loading") / "run", progress=False)


def one_line_error(fn, *args, match: str = "", **kwargs) -> str:
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def tokens(n: int = 4, t: int = 9, vocab: int = 13) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(0))


def as_old_folder(d):
    """Rewrite the run folder ``d`` as older versions wrote it: weights (``model.*``), optimizer state and extras in
    one file per state, no optimizer file."""
    for path in [d / "model.safetensors", *sorted((d / "ckpt").glob("step_??????.safetensors"))]:
        opt = path.with_name("optimizer.safetensors" if path.name == "model.safetensors"
                             else f"{path.stem}.optimizer.safetensors")
        meta = json.loads(path.with_suffix(".json").read_text())
        meta.pop("sha256"), meta.pop("optimizer_sha256")
        tensors = {f"model.{k}": v for k, v in load_file(path).items()} | load_file(opt)
        opt.unlink()
        save_tensors(path, tensors, meta)


# ---------------------------------------------------------------- the files


def test_model_file_holds_the_weights_alone_and_the_optimizer_file_the_adam_state(run):
    weights, opt = load_file(run.dir / "model.safetensors"), load_file(run.dir / "optimizer.safetensors")
    model = GPT(run.model_config())
    assert weights.keys() == model.state_dict().keys()
    model.load_state_dict(weights)  # a file the model takes as it is
    names = [n for n, _ in model.named_parameters()]
    assert opt.keys() == {f"adam.{m}.{n}" for m in ("exp_avg", "exp_avg_sq") for n in names}
    meta, state = read_state(run.dir / "model.safetensors", "cpu")
    assert meta["adam_step"] == TINY.steps
    assert all(torch.equal(state[f"model.{k}"], v) for k, v in weights.items())
    assert all(torch.equal(state[k], v) for k, v in opt.items())
    ckpt = load_file(run.dir / "ckpt" / "step_000003.safetensors")
    assert ckpt.keys() == weights.keys()
    assert (run.dir / "ckpt" / "step_000003.optimizer.safetensors").exists()


def test_extending_a_run_moves_its_final_optimizer_state_with_its_weights(run, tmp_path):
    """Extending a run turns its final state into the checkpoint of its last step (ntpflow.runs.training._extend):
    the weights, their sidecar and the optimizer file move together, and the checkpoint reads whole."""
    from ntpflow.runs.training import _extend

    d = tmp_path / "run"
    shutil.copytree(run.dir, d)
    old = Run.open(d)
    _extend(old, replace(old.cfg, steps=old.cfg.steps + 4))
    step = old.cfg.steps
    assert not (d / "optimizer.safetensors").exists() and not (d / "model.safetensors").exists()
    _, state = read_state(d / "ckpt" / f"step_{step:06d}.safetensors", "cpu")
    opt = load_file(run.dir / "optimizer.safetensors")
    assert all(torch.equal(state[k], v) for k, v in opt.items())


def test_a_run_folder_of_older_versions_loads_and_resumes_bit_for_bit(run, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(run.dir, d)
    as_old_folder(d)
    assert not list(d.rglob("*optimizer*")) and "adam_step" in json.loads((d / "model.json").read_text())
    old = Run.open(d)
    for which in ("final", 3, "init"):
        assert all(torch.equal(a, b) for a, b in zip(old.load_model(which).state_dict().values(),
                                                       run.load_model(which).state_dict().values()))
    batch = tokens(vocab=len(run.task.vocab), t=run.task.seq_len)
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(d)(batch), run.load_model()(batch))
    for name in ("DONE", "model.safetensors", "model.json"):
        (d / name).unlink()
    train(TINY, d, progress=False)  # resumes from the old-format checkpoint of step 3
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(d / name), load_file(run.dir / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- GPT.from_pretrained


def test_from_pretrained_loads_a_run_folder(run):
    model = GPT.from_pretrained(run.dir)
    assert model.cfg == run.model_config()
    weights = load_file(run.dir / "model.safetensors")
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert GPT.from_pretrained(str(run.dir), myopic="kv").cfg.myopic == "kv"


def test_from_pretrained_of_an_unfinished_run_says_what_to_call(run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(run.dir, d)
    for name in ("DONE", "model.safetensors", "model.json"):
        (d / name).unlink()
    msg = one_line_error(GPT.from_pretrained, d, match="has not finished")
    assert f"Run.open({str(d)!r}).load_model(STEP)" in msg and f"Run.open({str(d)!r}).checkpoints()" in msg


def test_from_pretrained_of_a_missing_folder_a_file_or_a_tl_folder_is_one_line(tmp_path):
    one_line_error(GPT.from_pretrained, str(tmp_path / "nope" / "run"), match="no such folder")
    one_line_error(GPT.from_pretrained, "runs/mine", match="no such folder, nor a hub model")
    (tmp_path / "w.safetensors").write_bytes(b"x")
    one_line_error(GPT.from_pretrained, tmp_path / "w.safetensors", match="is a file")
    (tmp_path / "tl").mkdir()
    (tmp_path / "tl" / "tl_config.json").write_text("{}")
    one_line_error(GPT.from_pretrained, tmp_path / "tl", match=r"TransformerLens.*load_local")
    (tmp_path / "empty").mkdir()
    one_line_error(GPT.from_pretrained, tmp_path / "empty", match="holds no model")


@pytest.fixture
def hf_folder(tmp_path):
    model = GPT(GPTConfig(vocab_size=13, n_ctx=9, n_layer=2, n_head=2, d_model=16), seed=3).eval()
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def test_from_pretrained_reads_a_gpt2_folder_exactly(hf_folder):
    model, path = hf_folder
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(path)(tokens()), model(tokens()))


def _rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage, match", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), r"'transformer.h.1.mlp.c_fc.bias' is missing"),
    (lambda t: t.update(extra=torch.zeros(2)), r"'extra' is not one of the model's"),
    (lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(16, 40)}),
     r"'transformer.h.0.attn.c_attn.weight' has shape \[16, 40\]; the model's is \[16, 48\]"),
    (lambda t: t.update({"transformer.ln_f.bias": torch.zeros(16, dtype=torch.int64)}),
     r"'transformer.ln_f.bias' has dtype torch.int64"),
    (lambda t: t.update({"model.wte": t.pop("transformer.wte.weight")}), r"'model.wte' is not one of the model's"),
])
def test_from_pretrained_names_the_first_bad_tensor(hf_folder, damage, match):
    _, path = hf_folder
    _rewrite(path, damage)
    one_line_error(GPT.from_pretrained, path, match=match)


def test_from_pretrained_of_truncated_weights_or_another_width_is_one_line(hf_folder):
    _, path = hf_folder
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "n_embd": 32}))
    one_line_error(GPT.from_pretrained, path, match=r"'transformer.wte.weight' has shape \[13, 16\]")
    (path / "config.json").write_text(json.dumps(config))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    one_line_error(GPT.from_pretrained, path, match="corrupted")


def test_a_run_checkpoint_of_another_width_names_its_first_tensor(run, tmp_path):
    other = train(replace(TINY, d_model=16, steps=1, ckpt_every=1, eval_every=1, log_every=1), tmp_path / "small",
                  progress=False)
    (tmp_path / "copy").mkdir()
    copy = Run(tmp_path / "copy", TINY)
    shutil.copy(other.dir / "model.safetensors", copy.dir / "model.safetensors")
    one_line_error(copy.load_model, "final", match=r"does not match the run's model: tensor 'wte' has shape")
