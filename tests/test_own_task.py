"""A task of one's own, named by its import path: the worked example of docs/tasks.md, run as written."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ntpflow import TrainConfig, make_task
from ntpflow.cli import main
from ntpflow.runs.run import Run

DOC = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"


@pytest.fixture
def mytasks(tmp_path, monkeypatch) -> Path:
    """docs/tasks.md's example saved as ``mytasks.py`` in a folder on the import path; returns the folder."""
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "mytasks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mytasks", None)
    yield tmp_path
    sys.modules.pop("mytasks", None)


def test_the_example_task_samples_what_it_promises(mytasks):
    task = make_task("mytasks:Parity", n_bits=5)
    b = task.sample(64, np.random.default_rng(0))
    bits = b.tokens[:, 1:6] - 2
    assert (b.tokens[:, 0] == 1).all() and (b.tokens[:, -1] - 2 == bits.sum(1) % 2).all()  # hand-worked parity
    assert (b.features[:, 1:6, 0] == np.cumsum(bits, 1) % 2).all() and b.loss_mask.sum() == 64


def test_a_task_by_import_path_trains_and_reopens_in_a_new_process(mytasks, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["-q", "train", "--task", "mytasks:Parity", "--out", str(run_dir), "--device", "cpu", "--set",
                 "steps=6", "n_layer=1", "d_model=32", "n_head=2", "batch_size=32", "n_train=256", "n_eval=128",
                 "eval_every=3", "ckpt_every=3", "log_every=3"]) == 0
    assert Run.open(run_dir).cfg.task == "mytasks:Parity"  # the import path is stored in config.json
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mytasks), os.environ.get("PYTHONPATH", "")])}
    for args in (["probe", str(run_dir), "--feature", "prefix_parity"],
                 ["attribute", str(run_dir), "--sites", "1:3", "--device", "cpu"]):
        out = subprocess.run([sys.executable, "-m", "ntpflow", "-q", *args], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    assert Run.open(run_dir).attribution().done


@pytest.mark.parametrize("task,fragment", [
    ("nosuchmodule_xyz:Task", "cannot import task 'nosuchmodule_xyz:Task'"),
    ("mytasks:Nope", "cannot import task 'mytasks:Nope'"),
    ("numpy:ndarray", "is not an ntpflow task: numpy:ndarray must subclass ntpflow.Task"),
    ("no_such_builtin", "unknown task 'no_such_builtin'"),
])
def test_a_bad_task_name_is_a_one_line_error_and_writes_nothing(mytasks, tmp_path, capsys, task, fragment):
    out = tmp_path / "run"
    assert main(["train", "--task", task, "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and not out.exists()
    with pytest.raises(ValueError, match=re.escape(fragment)):
        TrainConfig(task=task)


def _majority_arrays(n: int = 384) -> tuple[dict[str, np.ndarray], list[str]]:
    task = make_task("majority")
    b = task.sample(n, np.random.default_rng(0))
    return ({"tokens": b.tokens, "loss_mask": b.loss_mask, "features": b.features, "useful": task.useful,
             "legal": b.legal}, list(task.feature_names))


def _write(path: Path, arrays: dict[str, np.ndarray], names: list[str]) -> Path:
    """The task file in the format its suffix names."""
    if path.suffix == ".npz":
        np.savez(path, feature_names=np.array(names), **arrays)
    elif path.suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path),
                  metadata={"feature_names": json.dumps(names)})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = len(arrays["tokens"])
        cols = {k: v.reshape(n, -1).tolist() for k, v in arrays.items() if k != "useful"}
        meta = {"feature_names": json.dumps(names), "shapes": json.dumps({k: v.shape for k, v in arrays.items()})}
        table = pa.table(cols).replace_schema_metadata(meta)
        pq.write_table(table, path)
    return path


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".parquet"])
def test_a_task_file_reads_back_the_sequences_it_holds(tmp_path, suffix):
    arrays, names = _majority_arrays(64)
    if suffix == ".parquet":
        del arrays["useful"]  # a table holds per-sequence rows; [T, F] does not fit one
    task = make_task(f"file:{_write(tmp_path / ('t' + suffix), arrays, names)}")
    train, evals = task.make_datasets(40, 24, seed=0)
    assert np.array_equal(train.tokens, arrays["tokens"][:40]) and np.array_equal(evals.features, arrays["features"][40:])
    assert task.feature_names == tuple(names) and np.array_equal(evals.legal, arrays["legal"][40:])


def test_a_task_file_trains_and_attributes_in_new_processes(tmp_path):
    arrays, names = _majority_arrays()
    path = _write(tmp_path / "maj.npz", arrays, names)
    run_dir = tmp_path / "run"
    steps = [["train", "--task", f"file:{path}", "--out", str(run_dir), "--device", "cpu", "--set", "steps=6",
              "n_layer=1", "d_model=32", "n_head=2", "batch_size=32", "n_train=256", "n_eval=128", "eval_every=3",
              "ckpt_every=3", "log_every=3"],
             ["probe", str(run_dir), "--feature", names[0]],
             ["attribute", str(run_dir), "--sites", "1:3", "--features", names[0], "--device", "cpu"]]
    for args in steps:
        out = subprocess.run([sys.executable, "-m", "ntpflow", "-q", *args], capture_output=True, text=True,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    assert Run.open(run_dir).attribution().done


@pytest.mark.parametrize("change,fragment", [
    (lambda a: a.pop("loss_mask"), "missing field 'loss_mask'"),
    (lambda a: a.update(features=a["features"][:, :3]), "field 'features' has shape"),
    (lambda a: a.update(useful=a["useful"][:2]), "field 'useful' has shape"),
    (lambda a: a.update(extra=a["tokens"]), "unknown field(s) ['extra']"),
    (lambda a: a.update(tokens=a["tokens"].astype(np.float32)), "field 'tokens' must be non-negative integers"),
])
def test_a_bad_task_file_is_a_one_line_error_naming_the_field(tmp_path, capsys, change, fragment):
    arrays, names = _majority_arrays(64)
    change(arrays)
    path = _write(tmp_path / "bad.npz", arrays, names)
    out = tmp_path / "run"
    assert main(["train", "--task", f"file:{path}", "--out", str(out), "--device", "cpu", "--set", "n_train=32",
                 "n_eval=16", "batch_size=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and fragment in err and not out.exists()
