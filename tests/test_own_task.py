"""A task of one's own, named by its import path: the worked example of docs/tasks.md, run as written."""

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
