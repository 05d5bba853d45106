"""The run folder belongs to ``Run``: no other code spells a path inside it, and one command reads a run once."""

import ast
import sys
from collections import Counter
from pathlib import Path

import ntpflow.runs.data
from ntpflow import TrainConfig, train
from ntpflow.cli import main
from ntpflow.files import load_tensors
from ntpflow.runs.group import train_group

PACKAGE = Path(__file__).resolve().parents[1] / "ntpflow"
OWNER = PACKAGE / "runs" / "run.py"
# every name inside a run folder (and inside the replay folders it holds)
NAMES = {"DONE", "config.json", "env.json", "metrics.jsonl", "threads.json", "group.json", "init.safetensors",
         "init.json", "model.safetensors", "model.json", "optimizer.safetensors", "ckpt", "probes", "probes_init",
         "attribution", "balance", "influence.parquet", "spec.json", "parts", "state", "sweep.json", "FAILED"}
PREFIXES = ("probes_", "step_", "part_", "attribution", "classifier_")


def _spells_a_run_path(node: ast.AST) -> bool:
    """``x / "DONE"``, ``x / f"probes_{w}"``, ``x.glob("attribution*")``, ``InFolder("DONE")`` and the like."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in NAMES or node.value.startswith(PREFIXES)
    if isinstance(node, ast.JoinedStr):
        head = node.values[0] if node.values else None
        return isinstance(head, ast.Constant) and str(head.value).startswith(PREFIXES)
    return False


def run_paths_spelled(path: Path) -> list[str]:
    """The places in ``path`` that join a run-folder name onto a path or glob for one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _spells_a_run_path(node.right):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
        elif (isinstance(node, ast.Call) and node.args and _spells_a_run_path(node.args[0])
              and (isinstance(node.func, ast.Attribute) and node.func.attr in ("glob", "rglob")
                   or isinstance(node.func, ast.Name) and node.func.id == "InFolder")):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_only_run_spells_a_path_inside_a_run_folder():
    spelled = [p for f in sorted(PACKAGE.rglob("*.py")) if f != OWNER for p in run_paths_spelled(f)]
    assert spelled == []


def test_the_path_check_finds_a_spelled_path(tmp_path):
    f = PACKAGE / "_probe_for_the_check.py"  # parsed only, never imported
    try:
        f.write_text('from pathlib import Path\nd = Path("r")\na = d / "DONE"\nb = d / f"probes_{3}"\n'
                     'c = list(d.glob("attribution*"))\nok = d / "figures"\ne = InFolder("DONE")\n')
        assert sorted(run_paths_spelled(f)) == ["ntpflow/_probe_for_the_check.py:3", "ntpflow/_probe_for_the_check.py:4",
                                        "ntpflow/_probe_for_the_check.py:5", "ntpflow/_probe_for_the_check.py:7"]
    finally:
        f.unlink()


TINY = dict(task="majority", n_layer=1, d_model=32, n_head=2, steps=8, batch_size=32, n_train=256, n_eval=128,
            eval_every=4, ckpt_every=4, log_every=2, device="cpu")


def count_reads(monkeypatch) -> tuple[Counter, Counter]:
    """Count dataset builds and tensor-file reads (by file) wherever the project imported the two functions."""
    builds, reads = Counter(), Counter()
    real_build = ntpflow.runs.data.make_datasets

    def counted_build(*args, **kwargs):
        builds["datasets"] += 1
        return real_build(*args, **kwargs)

    def counted_read(path, *args, **kwargs):
        reads[str(path)] += 1
        return load_tensors(path, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("ntpflow"):
            if getattr(module, "make_datasets", None) is real_build:
                monkeypatch.setattr(module, "make_datasets", counted_build)
            if getattr(module, "load_tensors", None) is load_tensors:
                monkeypatch.setattr(module, "load_tensors", counted_read)
    return builds, reads


def test_one_attribute_call_builds_the_data_once_and_reads_each_weights_file_once(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    train(TrainConfig(**TINY), run_dir, progress=False)
    builds, reads = count_reads(monkeypatch)
    assert main(["-q", "attribute", str(run_dir), "--sites", "1:3", "--device", "cpu"]) == 0
    assert builds == {"datasets": 1}
    assert reads[str(run_dir / "init.safetensors")] == 1 and reads[str(run_dir / "model.safetensors")] == 1


def test_a_group_replay_builds_each_members_data_once(tmp_path, monkeypatch):
    dirs = [tmp_path / "s0", tmp_path / "s1"]
    train_group([TrainConfig(**TINY, seed=s) for s in (0, 1)], dirs, progress=False)
    builds, reads = count_reads(monkeypatch)
    assert main(["-q", "attribute", str(dirs[0]), "--group", "--sites", "1:3", "--device", "cpu"]) == 0
    assert builds == {"datasets": 2}
    for d in dirs:
        assert reads[str(d / "init.safetensors")] == 1 and reads[str(d / "model.safetensors")] == 1
