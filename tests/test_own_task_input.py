"""What a researcher brings is checked before anything is written (issue 53, items 5 and 9): a task's first batch,
a task file, a task's own parameters (``--set``), ``split_at``. Every refusal is exit 2, one ``error:`` line, and no
folder left behind."""

import sys
from pathlib import Path

import numpy as np
import pytest

from ntpflow import TrainConfig
from ntpflow.cli import main
from ntpflow.runs.config import apply_overrides
from ntpflow.runs.run import Run

TINY = ["steps=2", "n_layer=1", "d_model=16", "n_head=2", "batch_size=8", "n_train=32", "n_eval=16",
        "eval_every=2", "ckpt_every=2", "log_every=2"]

MODULE = '''
import numpy as np
from ntpflow import Batch, Task


class Parity(Task):
    """docs/tasks.md's running parity, with its length as a parameter of its own (``--set n_bits=...``)."""
    name = "parity"
    config_fields = ("n_bits",)

    def __init__(self, n_bits: int = 6):
        self.n_bits = n_bits
        self.vocab = ("<pad>", "<bos>", "0", "1")
        self.seq_len = n_bits + 2
        self.feature_names = ("prefix_parity",)
        self.first_output_pos = n_bits
        self.useful = np.zeros((self.seq_len, 1), dtype=bool)

    def sample(self, n, rng):
        bits = rng.integers(0, 2, size=(n, self.n_bits))
        prefix = np.cumsum(bits, axis=1) % 2
        tokens = np.concatenate([np.ones((n, 1), dtype=np.int64), bits + 2, prefix[:, -1:] + 2], axis=1)
        loss_mask = np.zeros((n, self.seq_len), dtype=bool)
        loss_mask[:, self.n_bits] = True
        features = np.zeros((n, self.seq_len, 1), dtype=np.float32)
        features[:, 1:self.n_bits + 1, 0] = prefix
        return Batch(tokens=tokens, loss_mask=loss_mask, legal=None, features=features)


class Raises(Parity):
    def sample(self, n, rng):
        return 1 / 0


class ReturnsDict(Parity):
    def sample(self, n, rng):
        b = super().sample(n, rng)
        return {"tokens": b.tokens, "loss_mask": b.loss_mask}


def _reshaped(b, T):
    pad = max(0, T - b.seq_len)
    return Batch(tokens=np.pad(b.tokens, ((0, 0), (0, pad)), constant_values=2)[:, :T],
                 loss_mask=np.pad(b.loss_mask, ((0, 0), (0, pad)))[:, :T], legal=None,
                 features=np.pad(b.features, ((0, 0), (0, pad), (0, 0)))[:, :T])


class Longer(Parity):
    def sample(self, n, rng):
        return _reshaped(super().sample(n, rng), self.seq_len + 1)


class Shorter(Parity):
    def sample(self, n, rng):
        return _reshaped(super().sample(n, rng), self.seq_len - 1)


class BeyondVocab(Parity):
    def sample(self, n, rng):
        b = super().sample(n, rng)
        b.tokens[:, -1] = len(self.vocab)
        return b


class ThreeColumns(Parity):
    def sample(self, n, rng):
        b = super().sample(n, rng)
        return Batch(tokens=b.tokens, loss_mask=b.loss_mask, legal=None, features=np.repeat(b.features, 3, axis=2))


class NaNFeatures(Parity):
    def sample(self, n, rng):
        b = super().sample(n, rng)
        b.features[:] = np.nan
        return b


class IntMask(Parity):
    def sample(self, n, rng):
        b = super().sample(n, rng)
        return Batch(tokens=b.tokens, loss_mask=b.loss_mask.astype(np.int64), legal=None, features=b.features)


class NoCount(Parity):
    def sample(self, n, rng):
        b = super().sample(n, rng)
        b.loss_mask[:] = False
        return b


class Items(Parity):
    config_fields = ("n_items",)

    def __init__(self, n_items):
        super().__init__(n_items)
'''


@pytest.fixture
def own(tmp_path, monkeypatch) -> Path:
    """MODULE saved as ``owntasks.py`` on the import path."""
    (tmp_path / "owntasks.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("owntasks", None)
    yield tmp_path
    sys.modules.pop("owntasks", None)


def refused(capsys, args: list[str], out: Path, *fragments: str) -> str:
    """Run the command line; assert exit 2, one ``ntpflow: error:`` line holding ``fragments``, ``out`` absent."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("ntpflow: error: "), err
    assert all(f in err for f in fragments), err
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return err


def train_args(task: str, out: Path, *sets: str) -> list[str]:
    return ["-q", "train", "--task", task, "--out", str(out), "--device", "cpu", "--set", *TINY, *sets]


@pytest.mark.parametrize("cls,fragment", [
    ("Raises", "sample() failed: ZeroDivisionError"),
    ("ReturnsDict", "must return an ntpflow Batch, got dict"),
    ("Longer", "sequences of length 9, but its seq_len is 8"),
    ("Shorter", "sequences of length 7, but its seq_len is 8"),
    ("BeyondVocab", "token ids 1..4 outside its vocabulary 0..3"),
    ("ThreeColumns", "features have 3 columns for 1 feature_names"),
    ("NaNFeatures", "features must be finite numbers"),
    ("IntMask", "loss_mask must be boolean"),
    ("NoCount", "loss_mask counts no prediction"),
])
def test_a_bad_first_batch_is_refused_before_anything_is_written(own, tmp_path, capsys, cls, fragment):
    out = tmp_path / "run"
    refused(capsys, train_args(f"owntasks:{cls}", out), out, f"task owntasks:{cls}: ", fragment)


def test_a_task_module_that_does_not_import_is_a_one_line_error(own, tmp_path, capsys):
    (own / "broken.py").write_text("def oops(:\n")
    out = tmp_path / "run"
    refused(capsys, train_args("broken:Task", out), out, "cannot import task 'broken:Task': SyntaxError")
    refused(capsys, train_args("not_on_the_path_xyz:Task", out), out, "PYTHONPATH")


def test_a_task_parameter_is_set_with_set_and_reaches_the_task(own, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args("owntasks:Parity", out, "n_bits=4")) == 0
    run = Run.open(out)
    assert run.cfg.task_args == {"n_bits": 4} and run.task.seq_len == 6 and run.model_config().n_ctx == 6
    assert "vocab_size" not in run.cfg.to_dict() and "board_size" not in run.cfg.to_dict()  # not this task's
    default = TrainConfig(task="owntasks:Parity")
    assert default.task_args == {"n_bits": 6} and default.hash() != run.cfg.hash()
    assert apply_overrides(default, ["n_bits=5"]).task_args == {"n_bits": 5}
    refused(capsys, train_args("owntasks:Parity", tmp_path / "x", "n_items=6"), tmp_path / "x",
            "unknown config key 'n_items'", "the task's own: n_bits")
    refused(capsys, train_args("owntasks:Items", tmp_path / "y"), tmp_path / "y",
            "task owntasks:Items needs its parameter n_items (--set n_items=...)")
    assert main(train_args("owntasks:Items", tmp_path / "z", "n_items=3")) == 0



def test_a_config_is_rebuilt_from_its_overrides(own):
    """``TrainConfig.overrides()`` (what the account's workers are started with) rebuilds the config exactly: a
    task parameter of one's own, a string, the optimizer, the schedule, a None among them."""
    from ntpflow.runs.config import config_from

    for cfg in (TrainConfig(task="owntasks:Parity", task_args={"n_bits": 4}, lr=3e-4, seed=3),
                TrainConfig(task="stories", corpus="some/folder", optimizer="sgd", momentum=0.9, lr=0.03),
                TrainConfig(task="othello", board_size=6, warmup=200, decay="cosine", final_lr_frac=0.1, n_layer=4),
                TrainConfig(task="majority", regime="myopic-untied", data_seed=None, device="cpu")):
        assert config_from(cfg.overrides()) == cfg and config_from(cfg.overrides()).hash() == cfg.hash()


def test_split_at_defaults_to_the_tasks_first_output_and_errors_name_it(own, tmp_path, capsys):
    assert TrainConfig(task="majority").split_at == 10  # the built-in tasks keep their split
    assert TrainConfig(task="othello", regime="untied").split_at == 10
    cfg = TrainConfig(task="owntasks:Parity", regime="untied")
    assert cfg.split_at == 6  # first_output_pos of the 8-token task
    assert apply_overrides(cfg, ["n_bits=4"]).split_at == 4  # resolved again for the task as set
    assert apply_overrides(cfg, ["split_at=0"]).split_at == 0
    assert TrainConfig(task="owntasks:Parity").split_at is None  # unused outside the untied regimes
    out = tmp_path / "run"
    assert main(train_args("owntasks:Parity", out, "regime='untied'")) == 0
    assert Run.open(out).model_config().position_groups == (0,) * 6 + (1,) * 2
    refused(capsys, train_args("owntasks:Parity", tmp_path / "x", "regime='untied'", "split_at=10"), tmp_path / "x",
            "split_at must be 0 (untie every position) or in 1..7 (the task has 8 positions), got 10")


# ---- file tasks ----------------------------------------------------------------------------------------------


def _arrays(n: int = 48) -> dict[str, np.ndarray]:
    from ntpflow import make_task

    b = make_task("majority").sample(n, np.random.default_rng(0))
    return {"tokens": b.tokens, "loss_mask": b.loss_mask, "features": b.features}


@pytest.mark.parametrize("change,fragment", [
    (lambda a: a["features"].__setitem__((0, 3, 0), np.nan), "field 'features' must be finite numbers"),
    (lambda a: a.update(loss_mask=np.where(a["loss_mask"], "yes", "no")), "field 'loss_mask' must be boolean"),
    (lambda a: a.update(tokens=a["tokens"][:0], loss_mask=a["loss_mask"][:0], features=a["features"][:0]),
     "holds 0 sequences"),
])
def test_a_bad_task_file_is_refused_before_anything_is_written(tmp_path, capsys, change, fragment):
    arrays = _arrays()
    change(arrays)
    np.savez(tmp_path / "bad.npz", **arrays)
    out = tmp_path / "run"
    refused(capsys, train_args(f"file:{tmp_path / 'bad.npz'}", out), out, fragment)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04trunc"], ids=["empty", "truncated"])
@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".parquet"])
def test_an_unreadable_task_file_is_a_one_line_error(tmp_path, capsys, content, suffix):
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(content)
    out = tmp_path / "run"
    refused(capsys, train_args(f"file:{path}", out), out, str(path), "cannot read the task file")


def test_a_task_file_too_small_for_the_run_leaves_nothing_and_the_corrected_command_works(tmp_path, capsys):
    np.savez(tmp_path / "mine.npz", **_arrays())
    out = tmp_path / "run"
    args = ["-q", "train", "--task", f"file:{tmp_path / 'mine.npz'}", "--out", str(out), "--device", "cpu"]
    refused(capsys, args, out, "holds 48 sequences; n_train=102400 + n_eval=10240 do not fit")
    assert main(args + ["--set", *TINY]) == 0  # the same --out, once corrected


def test_a_task_files_default_run_name_is_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        np.savez(tmp_path / sub / "mine.npz", **_arrays())
        assert main(["-q", "train", "--task", f"file:{sub}/mine.npz", "--device", "cpu", "--set", *TINY]) == 0
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(names) == 2 and all(n.startswith("mine-") and n.endswith("-vanilla-s0") for n in names), names


def test_the_documented_file_command_trains(tmp_path, monkeypatch):
    """docs/own-question.md §2's train command, as written (smaller and shorter), on a file of the size it sets."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "own-question.md").read_text()
    args = next(s for s in doc.splitlines() if s.startswith("ntpflow train --task file:")).split()[1:]
    sets = args[args.index("--set") + 1:]
    n = sum(int(s.split("=")[1]) for s in sets if s.startswith(("n_train=", "n_eval=")))
    assert n < 112_640  # the defaults would need 112,640 sequences
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    np.savez(args[2].removeprefix("file:"), **_arrays(n))
    small = ["steps=2", "n_layer=1", "d_model=16", "n_head=2", "eval_every=2", "ckpt_every=2", "log_every=2"]
    assert main(["-q", *args, *small, "--device", "cpu"]) == 0 and Run.open(args[args.index("--out") + 1]).done


def test_a_sweep_setting_can_be_a_task_parameter(own):
    assert TrainConfig.from_values({"task": "owntasks:Parity", "n_bits": 3, "steps": 5}).task_args == {"n_bits": 3}
    with pytest.raises(ValueError, match="unknown config key"):
        TrainConfig.from_values({"task": "owntasks:Parity", "n_items": 3})


# ---- attribute and qscan -------------------------------------------------------------------------------------


def test_attribute_an_unknown_feature_leaves_no_folder(own, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args("owntasks:Parity", run)) == 0
    for out in (run / "attribution", tmp_path / "att"):
        refused(capsys, ["attribute", str(run), "--sites", "1:3", "--features", "no_such", "--out", str(out),
                         "--device", "cpu"], out, "unknown feature(s) ['no_such']")


@pytest.mark.parametrize("make", [
    lambda p: p.write_text(""),
    lambda p: p.write_text("\n  \n\t\n"),
    lambda p: p.write_bytes(b"\xff\xfe text \x80"),
    lambda p: (p.mkdir(), (p / "notes.md").write_text("text")),
], ids=["empty", "blank", "not-utf8", "folder-without-txt"])
def test_qscan_a_domain_without_text_leaves_no_folder(tmp_path, capsys, make):
    make(tmp_path / "news")
    out = tmp_path / "q"
    code = main(["qscan", "--model", "tiny", "--train-sae", "--domains", f"news:{tmp_path / 'news'}", "--out", str(out),
                 "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("ntpflow qscan: error: domain 'news'"), err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["npy-strings", "npy-truncated", "safetensors-truncated", "sae-truncated"])
def test_a_bad_direction_or_sae_file_is_one_line(tmp_path, kind):
    """A .npy of strings, a truncated .npy or .safetensors direction, a truncated SAE weights file: a one-line
    ValueError naming the file (the CLI's exit 2), not a library's own error type."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from ntpflow.model.sites import Site
    from ntpflow.replay.directions import read_vector, sae_directions

    if kind == "npy-strings":
        np.save(tmp_path / "v.npy", np.array(["a", "b"]))
        call, name = (lambda: read_vector(tmp_path / "v.npy")), "v.npy"
    elif kind == "npy-truncated":
        np.save(tmp_path / "v.npy", np.ones(16, dtype=np.float32))
        (tmp_path / "v.npy").write_bytes((tmp_path / "v.npy").read_bytes()[:100])
        call, name = (lambda: read_vector(tmp_path / "v.npy")), "v.npy"
    elif kind == "safetensors-truncated":
        save_file({"w": torch.ones(16)}, str(tmp_path / "v.safetensors"))
        (tmp_path / "v.safetensors").write_bytes((tmp_path / "v.safetensors").read_bytes()[:40])
        call, name = (lambda: read_vector(tmp_path / "v.safetensors", "w")), "v.safetensors"
    else:
        sae = tmp_path / "sae"
        sae.mkdir()
        (sae / "cfg.json").write_text('{"hook_name": "blocks.0.hook_resid_post"}')
        save_file({"W_dec": torch.ones(4, 16)}, str(sae / "sae_weights.safetensors"))
        (sae / "sae_weights.safetensors").write_bytes((sae / "sae_weights.safetensors").read_bytes()[:40])
        call, name = (lambda: sae_directions(sae, [0], Site(1, 2))), "sae_weights.safetensors"
    with pytest.raises(ValueError) as e:
        call()
    assert name in str(e.value) and "\n" not in str(e.value)
