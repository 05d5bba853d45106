"""The command line, called in-process through ``ntpflow.cli.main`` (plus one real ``python -m ntpflow``)."""

import csv
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ntpflow import TrainConfig
from ntpflow.cli import main
from ntpflow.probes import ProbeSet
from ntpflow.runs.run import Run

TINY_SET = ["n_layer=1", "d_model=32", "n_head=2", "steps=12", "batch_size=32", "n_train=256", "n_eval=128",
            "eval_every=6", "ckpt_every=4", "log_every=2"]


def train_args(out: Path, *extra: str) -> list[str]:
    return ["train", "--task", "majority", "--regime", "vanilla", "--device", "cpu", "--out", str(out), *extra,
            "--set", *TINY_SET]


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


def assert_one_line_error(capsys, *fragments: str):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ntpflow: error: "), err
    for f in fragments:
        assert f in lines[0], err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    from ntpflow.runs.training import train

    out = tmp_path_factory.mktemp("cli") / "run"
    cfg = TrainConfig(task="majority", n_layer=1, d_model=32, n_head=2, steps=12, batch_size=32, n_train=256,
                      n_eval=128, eval_every=6, ckpt_every=4, log_every=2, device="cpu")
    train(cfg, out, progress=False)
    return out


# ---------------------------------------------------------------- working commands


def test_train_then_probe(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(out, "--seed", "2")) == 0
    assert capsys.readouterr().out.strip() == str(out)
    run = Run.open(out)
    assert run.done
    assert run.cfg == TrainConfig(task="majority", regime="vanilla", seed=2, device="cpu", n_layer=1, d_model=32,
                                  n_head=2, steps=12, batch_size=32, n_train=256, n_eval=128, eval_every=6,
                                  ckpt_every=4, log_every=2)

    assert main(["probe", str(out), "--feature", "is_majority_<1>", "--device", "cpu"]) == 0  # the old name is read
    table = capsys.readouterr().out
    assert "is_majority_1" in table and "is_majority_0" not in table and "<" not in table
    lines = table.strip().splitlines()
    assert lines[0].startswith(f"run {out} (majority, vanilla, seed 2): weights final (step 12 of 12); ")
    assert lines[2].split()[0] == "layer" and "p1" in lines[2].split()
    assert [line.split()[0] for line in lines[3:5]] == ["0", "1"]  # resid layers 0..n_layer
    assert lines[-1] == f"every feature's table: {out / 'probes' / 'r.csv'}"
    assert (out / "probes" / "probes.json").exists()
    trained, untrained = ProbeSet.load(out / "probes"), ProbeSet.load(out / "probes_init")
    f = trained.feature_index("is_majority_<1>")
    cells = re.findall(r"(-?\d\.\d\d) \((-?\d\.\d\d)\)", lines[4])  # layer 1: each cell "r (r_init)"
    assert [float(x) for c in cells for x in c] == pytest.approx(
        [float(ps.r[1, p, f]) for p in trained.positions for ps in (trained, untrained)], abs=0.005)
    with open(out / "probes" / "r.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(trained.feature_names) * 2 * len(trained.positions)
    for row in rows:
        fi, at = trained.feature_index(row["feature"]), (int(row["layer"]), int(row["pos"]))
        for col, probes in (("r", trained), ("r_init", untrained)):
            want = float(probes.r[at[0], at[1], fi])
            assert (row[col] == "") if math.isnan(want) else float(row[col]) == want
    side = json.loads((out / "probes" / "r.json").read_text())
    assert (side["run"], side["weights"], side["step"]) == (str(out), "final", 12)
    assert set(side["stamp"]) == {"ntpflow", "git_commit", "git_dirty", "date", "command"}

    assert main(["probe", str(out), "--weights", "4", "--device", "cpu"]) == 0  # a checkpoint, all features
    table = capsys.readouterr().out
    assert all(f"is_majority_{v}" in table for v in range(3))
    assert (out / "probes_4" / "probes.json").exists()


def test_train_rerun_of_finished_run_is_a_noop(finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = snapshot(out)
    assert main(train_args(out)) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert snapshot(out) == before


# ---------------------------------------------------------------- bad input: exit 2, one line


@pytest.mark.parametrize("args,fragments", [
    (["--task", "nope"], ["unknown task", "nope"]),
    (["--regime", "sideways"], ["unknown regime", "sideways"]),
    (["--set", "bogus=1"], ["unknown config key", "bogus"]),
    (["--set", "steps=abc"], ["bad value", "steps"]),
    (["--set", "lr=fast"], ["bad value", "lr"]),
    (["--set", "steps"], ["key=value"]),
    (["--set", "steps=0"], ["steps must be positive"]),
])
def test_train_bad_config(tmp_path, capsys, args, fragments):
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--out", str(out), *args]) == 2
    assert_one_line_error(capsys, *fragments)
    assert not out.exists()


def test_probe_bad_weights(finished_run, capsys):
    before = snapshot(finished_run)
    assert main(["probe", str(finished_run), "--weights", "abc", "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "unknown weights", "abc")
    assert main(["probe", str(finished_run), "--weights", "999", "--device", "cpu"]) == 2
    steps = ", ".join(map(str, Run.open(finished_run).checkpoints()))
    assert steps  # the line lists the weights that exist
    assert_one_line_error(capsys, "missing checkpoint", "step_000999", "final, init", f"checkpoint steps {steps}")
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("sites,fragments", [
    ("abc", ["cannot parse sites", "abc"]),
    ("1:x", ["cannot parse sites"]),
    ("9:3", ["out of range", "layer"]),
    ("0:21", ["out of range", "pos"]),
])
def test_attribute_bad_sites(finished_run, tmp_path, capsys, sites, fragments):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert main(["attribute", str(run), "--sites", sites, "--device", "cpu"]) == 2
    assert_one_line_error(capsys, *fragments)
    assert not (run / "attribution" / "influence.parquet").exists()


def test_attribute_empty_site_list_is_an_error(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert main(["attribute", str(run), "--sites", "1:3-1", "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "sites")


def test_probe_unknown_feature(finished_run, tmp_path, capsys, monkeypatch):
    """The name is checked before any probe is fitted: one line, exit 2, nothing written."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)

    def no_fit(*args, **kwargs):
        raise AssertionError("probes fitted before the feature name was checked")

    monkeypatch.setattr("ntpflow.cli.probe_run", no_fit)
    assert main(["probe", str(run), "--feature", "nonsense", "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "unknown feature", "nonsense", "is_majority_0")
    assert snapshot(run) == before


def test_probe_non_run_directory(tmp_path, capsys):
    assert main(["probe", str(tmp_path), "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "not a run directory")
    assert main(["probe", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "not a run directory")


def test_probe_unfinished_run_needs_a_checkpoint(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "DONE").unlink()
    assert main(["probe", str(run), "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "has not finished training")


def test_probe_corrupted_weights(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    path = run / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    assert main(["probe", str(run), "--device", "cpu"]) == 2
    assert_one_line_error(capsys, "corrupted checkpoint")


def test_train_unwritable_output(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert main(train_args(blocker / "run")) == 2
    assert_one_line_error(capsys, "cannot write to")
    assert blocker.read_text() == "not a directory"


def test_train_different_config_into_existing_run(finished_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "DONE").unlink()  # an unfinished run would otherwise be resumed with the new config
    before = snapshot(out)
    assert main(train_args(out) + ["lr=3e-3"]) == 2
    assert_one_line_error(capsys, "different config", "lr")
    assert main(train_args(out, "--seed", "1")) == 2
    assert_one_line_error(capsys, "different config", "seed")
    assert snapshot(out) == before
    assert json.loads((out / "config.json").read_text())["train"]["lr"] == 1e-3


def test_argparse_errors_exit_2(capsys):
    for argv in ([], ["train", "--seed", "x"], ["fly"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "ntpflow" in capsys.readouterr().err


# ---------------------------------------------------------------- help


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert "ntpflow train --task majority --regime myopic --seed 0 --out runs/maj-myopic-s0" in out
    assert "ntpflow probe runs/maj-myopic-s0" in out
    assert "Python equivalents:" in out
    for cmd in ("train", "probe", "demo"):
        assert cmd in out

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--set KEY=VALUE" in out and "examples:" in out


def test_python_m_help():
    res = subprocess.run([sys.executable, "-m", "ntpflow", "--help"], check=False, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: ntpflow")
    assert "examples:" in res.stdout and "ntpflow demo --out runs/demo" in res.stdout


def test_qscan_and_its_halves_go_through_the_face(tmp_path, capsys):
    """`ntpflow qscan [train|scan] OPTIONS`: the face hands every option to the qscan command line."""
    pytest.importorskip("transformers")
    assert main(["qscan", "scan", "--model", "tiny", "--out", str(tmp_path / "empty")]) == 2
    assert "holds no corpus and SAE" in capsys.readouterr().err
    assert main(["qscan", "--model", "tiny", "--sae", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["qscan", "train", "--model", "tiny", "--k", "0", "--out", str(tmp_path / "k")]) == 2
    assert "--k must be positive" in capsys.readouterr().err


def test_qscan_says_and_records_the_hook_it_scanned(tmp_path, capsys):
    """One stage line names the hook; stats.json (per mode), q_<mode>.json and the summary line record it."""
    pytest.importorskip("transformers")
    out = tmp_path / "q"
    assert main(["qscan", "--model", "tiny", "--train-sae", "--latents", "3", "--docs", "3", "--ctx-len", "40",
                 "--d-sae", "16", "--k", "2", "--steps", "10", "--candidates", "4", "--examples", "2",
                 "--kl-cutoff", "0", "--mode", "error-preserving", "--device", "cpu", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    said = re.findall(r"Q scan of 3 latents at hook (\S+) over", cap.err)
    assert len(said) == 1, cap.err
    hook = said[0]
    assert re.fullmatch(r"blocks\.\d+\.hook_resid_post", hook)
    assert json.loads((out / "stats.json").read_text())["error-preserving"]["hook"] == hook
    assert json.loads((out / "q_error-preserving.json").read_text())["extra"]["hook"] == hook
    assert f"(hook {hook})" in cap.out
