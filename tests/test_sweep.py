"""Sweeps: grid expansion, re-entry, a killed worker, a failing run, the tidy results table, submitit's local path."""

import json
import os
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from ntpflow.cli import main
from ntpflow.runs.sweep import SweepSpec, run_name, run_sweep

SETTINGS = {"n_layer": 1, "d_model": 16, "n_head": 2, "steps": 20, "batch_size": 32, "n_train": 256, "n_eval": 64,
            "eval_every": 10, "ckpt_every": 5, "log_every": 5, "device": "cpu"}
SPEC = {"name": "tiny", "grid": {"regime": ["vanilla", "myopic"], "seed": [0, 1]}, "settings": SETTINGS}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_grid_expands_in_spec_order_and_validates(tmp_path):
    spec = SweepSpec.from_dict(SPEC)
    assert [run_name(p) for p in spec.points()] == ["regime=vanilla,seed=0", "regime=vanilla,seed=1",
                                                      "regime=myopic,seed=0", "regime=myopic,seed=1"]
    assert [c.regime for _, c in spec.configs()] == ["vanilla", "vanilla", "myopic", "myopic"]
    toml = tmp_path / "s.toml"
    toml.write_text('name = "t"\n[grid]\nseed = [3, 4]\n[settings]\nsteps = 7\n')
    assert [c.steps for _, c in SweepSpec.load(toml).configs()] == [7, 7]
    for bad, msg in [({"grid": {}}, "needs a \\[grid\\]"), ({"grid": {"seed": [0]}, "oops": 1}, "unknown sweep spec"),
                     ({"grid": {"regime": ["sideways"]}}, "unknown regime"),
                     ({"grid": {"seed": [0]}, "settings": {"seed": 1}}, "both in")]:
        with pytest.raises(ValueError, match=msg):
            SweepSpec.from_dict(bad)


def _launch_in_subprocess(run_dir):
    proc = subprocess.run([sys.executable, "-m", "ntpflow.runs.sweep", str(run_dir)], env=ENV, capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}")


def test_sweep_survives_killed_worker_and_failing_run_then_reenters(tmp_path):
    killed, out = [], tmp_path / "sw"

    def launcher(run_dir):
        if run_dir.name == "regime=vanilla,seed=1" and not killed:  # SIGKILL this worker once, mid-training
            proc = subprocess.run([sys.executable, "-m", "ntpflow.runs.sweep", str(run_dir)],  # at a named point
                                  env={**ENV, "NTPFLOW_FAULT": "train:after_checkpoint:kill"}, capture_output=True,
                                  check=False)
            assert list((run_dir / "ckpt").glob("step_*.json")) and not (run_dir / "DONE").exists()
            killed.append(proc.returncode)
            raise RuntimeError("worker killed")
        if run_dir.name == "regime=myopic,seed=1":
            raise RuntimeError("disk on fire")
        _launch_in_subprocess(run_dir)

    spec = SweepSpec.from_dict({**SPEC, "retries": 1})
    run_sweep(spec, out, workers=2, progress=False, launcher=launcher)
    assert killed == [-signal.SIGKILL]
    rows = {r["run"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert {k: r["status"] for k, r in rows.items()} == {
        "regime=vanilla,seed=0": "done", "regime=vanilla,seed=1": "done",
        "regime=myopic,seed=0": "done", "regime=myopic,seed=1": "failed"}
    assert rows["regime=myopic,seed=1"]["error"] == "disk on fire"
    assert json.loads((out / "runs" / "regime=myopic,seed=1" / "FAILED").read_text())["attempts"] == 2
    assert rows["regime=vanilla,seed=0"]["regime"] == "vanilla" and rows["regime=vanilla,seed=0"]["eval_loss"] > 0

    # the killed run resumed from its checkpoint to the same weights as an uninterrupted run
    from safetensors.torch import load_file

    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "sweep.json").write_text((out / "runs" / "regime=vanilla,seed=1" / "sweep.json").read_text())
    _launch_in_subprocess(ref)  # same thread count as the sweep's workers
    a = load_file(out / "runs" / "regime=vanilla,seed=1" / "model.safetensors")
    b = load_file(ref / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    # re-entering skips finished runs and retries the failed one
    done = {d.name: (d / "DONE").stat().st_mtime_ns for d in (out / "runs").iterdir() if (d / "DONE").exists()}
    calls = []
    run_sweep(spec, out, workers=2, progress=False, launcher=lambda d: (calls.append(d.name), _launch_in_subprocess(d)))
    assert calls == ["regime=myopic,seed=1"]
    assert all((out / "runs" / n / "DONE").stat().st_mtime_ns == t for n, t in done.items())
    pd = pytest.importorskip("pandas")
    df = pd.read_parquet(out / "results.parquet")
    assert list(df["status"]) == ["done"] * 4 and df["error"].isna().all()


def test_cli_sweep_submitit_local_and_bad_spec(tmp_path, capsys):
    pytest.importorskip("submitit")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"grid": {"seed": [0]}, "settings": {**SETTINGS, "steps": 10}, "probe": True}))
    out = tmp_path / "out"
    assert main(["-q", "sweep", str(spec), "--out", str(out), "--executor", "submitit-local"]) == 0
    assert (out / "runs" / "seed=0" / "probes" / "probes.json").exists()
    assert pq.read_table(out / "results.parquet").to_pylist()[0]["status"] == "done"
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["-q", "sweep", str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert "cannot parse sweep spec" in capsys.readouterr().err
