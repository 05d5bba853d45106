"""Faults and bad input: nothing torn, nothing blocked for ever, no result lost, one clear line per error.

Crashes are injected at named points (``ntpflow.files.fault_point``, switched on by ``NTPFLOW_FAULT``), never by timing:
``NAME`` raises a SimulatedKill in this process, ``NAME:kill`` SIGKILLs a subprocess there, ``NAME:hang`` parks it.
"""

import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from ntpflow import Site, TrainConfig, train
from ntpflow.cli import main
from ntpflow.files import CorruptFileError, DirLock, SimulatedKill, load_tensors, save_tensors, write_json
from ntpflow.runs.run import Run, read_state
from ntpflow.runs.training import TrainingDiverged

TINY = TrainConfig(n_layer=1, d_model=16, n_head=2, steps=12, batch_size=32, n_train=256, n_eval=64, eval_every=6,
                   ckpt_every=3, log_every=3, device="cpu")
SETS = ["n_layer=1", "d_model=16", "n_head=2", "steps=12", "batch_size=32", "n_train=256", "n_eval=64",
        "eval_every=6", "ckpt_every=3", "log_every=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def same_tensors(a: dict, b: dict) -> bool:
    """Bit-identical tensor dicts (resuming must reproduce the uninterrupted run exactly, on one machine)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def weights(run_dir: Path) -> dict:
    return load_tensors(run_dir / "model.safetensors")


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory) -> Run:
    return train(TINY, tmp_path_factory.mktemp("ref") / "run", progress=False)


def _train_args(out: Path, *extra: str) -> list[str]:
    return ["-q", "train", "--task", "majority", "--device", "cpu", "--out", str(out), "--set", *SETS, *extra]


# ------------------------------------------------------------------------------------------ checkpoints


def test_tensor_files_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").exists() else fd))
        real_fsync(fd)

    def replace_(src, dst):
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace_)
    save_tensors(tmp_path / "w.safetensors", {"x": torch.ones(3)}, {"step": 1})
    tmp = next(src for kind, src in events if kind == "replace" and "w.safetensors" in src)
    assert ("fsync", tmp) in events[:events.index(("replace", tmp))] or not Path("/proc/self/fd").exists()
    assert json.loads((tmp_path / "w.json").read_text())["step"] == 1


@pytest.mark.parametrize("damage", ["rot", "missing", "optimizer rot", "optimizer missing"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(ref_run, tmp_path, caplog, damage):
    """A kill after the step-9 checkpoint, whose values (of the weights or of the optimizer file) then rot (valid
    header) or whose tensors vanish: the rerun warns, resumes from step 6 and ends bit-identical to the uninterrupted
    run."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(ref_run.dir, run_dir)
    for name in ("DONE", "model.safetensors", "model.json"):
        (run_dir / name).unlink()
    ckpt = run_dir / "ckpt" / ("step_000009.optimizer.safetensors" if "optimizer" in damage
                               else "step_000009.safetensors")
    if damage.endswith("rot"):
        data = bytearray(ckpt.read_bytes())
        data[-8:] = b"\x00\x00\xc0\x7f" * 2  # two float32 values overwritten (NaN): the header stays valid
        ckpt.write_bytes(bytes(data))
        with pytest.raises(CorruptFileError, match="checksum"):
            read_state(run_dir / "ckpt" / "step_000009.safetensors", "cpu")
    else:
        ckpt.unlink()
    with caplog.at_level("WARNING", logger="ntpflow.runs.training"):
        train(TINY, run_dir, progress=False)
    assert ("optimizer.safetensors" if "optimizer" in damage else ckpt.name) in caplog.text
    assert "falling back" in caplog.text
    assert same_tensors(weights(run_dir), weights(ref_run.dir))
    assert Run.open(run_dir).metrics() == ref_run.metrics()


def test_altered_final_weights_are_refused_not_probed(ref_run, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(ref_run.dir, run_dir, ignore=shutil.ignore_patterns("probes"))
    path = run_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(4)
    path.write_bytes(bytes(data))
    assert main(["-q", "probe", str(run_dir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors" in err and "checksum" in err
    assert not (run_dir / "probes").exists()


# ------------------------------------------------------------------------------------------ attribution


def test_attribution_resume_point_is_atomic(ref_run, tmp_path, monkeypatch):
    """Killed after the first resume point, then again between the state's tensors and its sidecar (the tear of
    old): the third run resumes from the first point and its influences equal an uninterrupted attribution."""
    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.member import resume_points
    from ntpflow.replay.spec import AttributionSpec

    spec = AttributionSpec([Site(1, 3)], ["is_majority_<0>"], block=3)
    ref = attribute(ref_run.dir, spec, out_dir=tmp_path / "ref", progress=False)
    out = tmp_path / "killed"
    monkeypatch.setenv("NTPFLOW_FAULT", "attribute:after_checkpoint")
    with pytest.raises(SimulatedKill):
        attribute(ref_run.dir, spec, out_dir=out, progress=False)
    monkeypatch.setenv("NTPFLOW_FAULT", "save_tensors:before_sidecar")
    with pytest.raises(SimulatedKill):
        attribute(ref_run.dir, spec, out_dir=out, progress=False)
    states = out / "state"

    def torn() -> list[str]:  # tensors without their sidecar: a write cut short
        return [p.name for p in states.glob("step_??????.safetensors") if not p.with_suffix(".json").exists()]

    assert resume_points(out).steps() == [3]  # the torn write never became a resume point
    assert torn() == ["step_000006.safetensors"]
    monkeypatch.delenv("NTPFLOW_FAULT")
    attribute(ref_run.dir, spec, out_dir=out, progress=False)
    assert not torn()
    key = ["step", "layer", "pos", "feature", "feature_type", "mismatch", "component", "optimizer"]
    a = pq.read_table(ref / "influence.parquet").to_pylist()
    b = pq.read_table(out / "influence.parquet").to_pylist()
    order = lambda rows: sorted(rows, key=lambda r: tuple(str(r.get(k)) for k in key))  # noqa: E731
    assert order(a) == order(b)


def test_maximizing_optimizer_is_refused():
    from ntpflow import GPT, GPTConfig
    from ntpflow.engine.influence import InfluenceTracker, Probe

    model = GPT(GPTConfig(vocab_size=5, n_ctx=4, n_layer=1, n_head=1, d_model=8), seed=0)
    tracker = InfluenceTracker(GPT(GPTConfig(vocab_size=5, n_ctx=4, n_layer=1, n_head=1, d_model=8), seed=1),
                               [Probe(Site(1, 1), "f", torch.ones(8))])
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="maximize"):
        tracker.track(model, torch.optim.Adam(model.parameters(), maximize=True), tokens, torch.ones(2, 4, dtype=bool))


# ------------------------------------------------------------------------------------------ locks


def test_lock_is_created_with_its_owner_and_a_dead_or_empty_one_is_taken_over(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("NTPFLOW_FAULT", "lock:before_owner")  # killed right after creating the lock
    with pytest.raises(SimulatedKill):
        train(TINY, run_dir, progress=False)
    assert json.loads((run_dir / ".lock").read_text()) == {"host": platform.node(), "pid": os.getpid()}
    monkeypatch.delenv("NTPFLOW_FAULT")
    assert train(TINY, run_dir, progress=False).done and not (run_dir / ".lock").exists()
    (run_dir / ".lock").write_text("")  # as older versions left it, killed between creating and filling it
    with DirLock(run_dir):
        assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
    assert not (run_dir / ".lock").exists()


def test_lock_of_another_host_says_how_to_release_it(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"host": platform.node() + "-elsewhere", "pid": 1}))
    assert main(_train_args(out)) == 2
    err = capsys.readouterr().err
    assert "on another host" in err and "--force-unlock" in err and not (out / "DONE").exists()
    assert main([*_train_args(out)[:2], "--force-unlock", *_train_args(out)[2:]]) == 0
    assert (out / "DONE").exists() and not (out / ".lock").exists()


def test_lock_held_by_a_live_process_is_refused(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom ntpflow.files import DirLock\n"
                               f"with DirLock({str(folder)!r}):\n    print('held', flush=True)\n    sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"in use by another process \\(host .*pid {holder.pid}\\)"):
            with DirLock(folder):
                pass
    finally:
        holder.stdin.close()
        holder.wait(30)
    with DirLock(folder):  # released with its process
        assert json.loads((folder / ".lock").read_text())["pid"] == os.getpid()


# ------------------------------------------------------------------------------------------ sweeps


SWEEP_SETTINGS = {**dict(s.split("=") for s in SETS), "device": "cpu"}
SWEEP_SETTINGS = {k: v if k == "device" else int(v) for k, v in SWEEP_SETTINGS.items()}


def test_sweep_grid_is_coerced_and_deduplicated(tmp_path):
    from ntpflow.runs.sweep import SweepSpec, run_sweep

    with pytest.raises(ValueError, match="bad value for steps: 30.0"):
        SweepSpec.from_dict({"grid": {"steps": [30.0]}})
    with pytest.raises(ValueError, match="beta1 must lie in"):
        SweepSpec.from_dict({"grid": {"seed": [0]}, "settings": {"beta1": 2}})
    spec = SweepSpec.from_dict({"grid": {"lr": [1, 1.0, 0.5], "seed": [0, 0]}})
    assert spec.points() == [{"lr": 1.0, "seed": 0}, {"lr": 0.5, "seed": 0}]
    bogus = SweepSpec.from_dict({"grid": {"seed": [0]}, "settings": {"device": "bogus"}})
    with pytest.raises(ValueError, match="sweep point seed=0: unknown device 'bogus'"):
        run_sweep(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_run_makes_the_sweep_exit_nonzero(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"grid": {"seed": [0, 0]}, "settings": SWEEP_SETTINGS, "retries": 0}))
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")  # every worker dies at its first checkpoint
    out = tmp_path / "out"
    assert main(["-q", "sweep", str(spec), "--out", str(out), "--workers", "1"]) == 1
    assert "1 of 1 runs failed (seed=0)" in capsys.readouterr().err
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["failed"]  # the duplicate point ran, and is reported, once
    monkeypatch.delenv("NTPFLOW_FAULT")
    assert main(["-q", "sweep", str(spec), "--out", str(out), "--workers", "1"]) == 0  # the rerun retries it


def test_sweep_workers_die_with_their_parent(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"grid": {"seed": [0]}, "settings": SWEEP_SETTINGS}))
    run_dir = tmp_path / "out" / "runs" / "seed=0"
    parent = subprocess.Popen([sys.executable, "-m", "ntpflow", "-q", "sweep", str(spec), "--out",
                               str(tmp_path / "out"), "--workers", "1"],
                              env={**ENV, "NTPFLOW_FAULT": "train:after_checkpoint:hang"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        deadline = time.monotonic() + 120  # waits for a state (the worker parked at its first checkpoint)
        while worker is None:
            assert parent.poll() is None and time.monotonic() < deadline
            if (run_dir / "ckpt" / "step_000003.json").exists() and (run_dir / ".lock").exists():
                worker = json.loads((run_dir / ".lock").read_text())["pid"]
            else:
                time.sleep(0.05)
        assert worker != parent.pid
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "the worker outlived its sweep"
    finally:
        if parent.poll() is None:
            parent.kill()
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)
    assert not (run_dir / "DONE").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # a zombie (dead, not yet reaped by its new parent) counts as gone
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


# ------------------------------------------------------------------------------------------ umask


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        save_tensors(tmp_path / "b.safetensors", {"x": torch.ones(1)}, {"step": 0})
        with DirLock(tmp_path):
            lock_mode = (tmp_path / ".lock").stat().st_mode & 0o777
    finally:
        os.umask(old)
    for name in ("a.json", "b.safetensors", "b.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert lock_mode == 0o666 & ~umask


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("extra, message", [
    (["--set", "beta1=2"], "beta1 must lie in [0, 1), got 2.0"),
    (["--set", "lr=1e999"], "lr must be positive and finite"),
    (["--seed", "-1"], "seed must be >= 0, got -1"),
    (["--device", "bogus"], "unknown device 'bogus'"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    assert main(_train_args(out, *extra) if extra[0] == "--set" else [*_train_args(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()
    assert main(_train_args(out)) == 0  # the corrected command is not refused as "a different config"


def test_cuda_without_cuda_fails_before_anything_is_written(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    assert main([*_train_args(out), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err and not out.exists()


def test_wandb_without_login_fails_before_anything_is_written(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    out = tmp_path / "run"
    assert main([*_train_args(out), "--track", "wandb"]) == 2
    assert "not logged in to W&B" in capsys.readouterr().err and not out.exists()


def test_non_finite_training_stops_keeps_checkpoints_and_never_writes_done(tmp_path):
    cfg = replace(TINY, lr=1e30, ckpt_every=1, log_every=1)
    with pytest.raises(TrainingDiverged, match="non-finite") as e:
        train(cfg, tmp_path / "run", progress=False)
    run = Run.open(tmp_path / "run")
    assert not run.done and not (run.dir / "model.safetensors").exists()
    for step in run.checkpoints():  # every checkpoint kept holds finite weights
        assert all(torch.isfinite(v).all() for v in load_tensors(run.weights_path(step)).values())
    last = run.checkpoints()[-1] if run.checkpoints() else None
    assert (f"last good checkpoint is step {last}" if last else "no checkpoint") in str(e.value)
    assert all(all(isinstance(v, str | int) or torch.isfinite(torch.tensor(v)) for v in m.values())
               for m in run.metrics())


def test_config_without_train_key_is_one_line(ref_run, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(ref_run.dir, run_dir)
    (run_dir / "config.json").write_text(json.dumps({"model": {}}))
    assert main(["-q", "probe", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and "'train'" in err


def test_truncated_probes_file_is_one_line(ref_run, tmp_path, capsys):
    import shutil

    from ntpflow.runs.probe import load_or_probe

    run_dir = tmp_path / "run"
    shutil.copytree(ref_run.dir, run_dir)
    load_or_probe(Run.open(run_dir), "final", "cpu")
    path = run_dir / "probes" / "probes.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    assert main(["-q", "attribute", str(run_dir), "--sites", "1:3", "--device", "cpu"]) == 2  # reads the probes
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "probes.safetensors" in err
    assert not (run_dir / "attribution" / "influence.parquet").exists()


def test_missing_extra_is_reported_before_any_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "res"
    assert main(["-q", "reproduce", "toy", "--out", str(out)]) == 2
    assert "needs matplotlib: pip install 'ntpflow[plot]'" in capsys.readouterr().err and not out.exists()


def test_internal_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):

    def broken(*a, **k):
        raise KeyError("oops")

    monkeypatch.setattr("ntpflow.cli.train", broken)
    assert main(_train_args(tmp_path / "run")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (KeyError)" in err and "--debug" in err
    with pytest.raises(KeyError):
        main(["--debug", *_train_args(tmp_path / "run")])


def test_qscan_k0_and_standard_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    from ntpflow.llm.qscan_cli import main as qscan

    base = ["--model", "tiny", "--train-sae", "--latents", "3", "--docs", "2", "--ctx-len", "40", "--d-sae", "16",
            "--steps", "10", "--candidates", "3", "--examples", "2", "--mode", "error-preserving"]
    assert qscan([*base, "--k", "0", "--out", str(tmp_path / "k0")]) == 2
    assert "--k must be positive, got 0" in capsys.readouterr().err and not (tmp_path / "k0").exists()
    assert qscan([*base, "--k", "2", "--out", str(tmp_path / "ok")]) == 0

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    stats = json.loads((tmp_path / "ok" / "stats.json").read_text(), parse_constant=refuse)
    json.loads((tmp_path / "ok" / "q_error-preserving.json").read_text(), parse_constant=refuse)
    sig = stats["error-preserving"]["sigma_lnq_formal"]
    assert sig["n"] >= 2 or sig["sigma"] is None  # undefined statistics are null
