"""The smoke-scale toy reproduction runs end to end and checks its own structure (no paper result asserted)."""

import json
import math
from pathlib import Path

import pytest
import torch
from _util import all_numbers

from ntpflow.cli import main
from ntpflow.experiments.claims import VERDICTS
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.run import Run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "smoke"
    assert main(["-q", "reproduce", "toy", "--scale", "smoke", "--out", str(out), "--workers", "2"]) == 0
    return out


@pytest.mark.one_thread
def test_smoke_structure(smoke):
    for name in ("data.json", "summary.json", "report.md", "report.html"):
        assert (smoke / name).exists(), name
    for fig in ("probe_majority", "probe_cond_majority", "task_success", "learning_curves", "influence_curves",
                "influence_bars"):
        assert (smoke / "figures" / f"{fig}.png").exists() and (smoke / "figures" / f"{fig}.svg").exists(), fig
    data = json.loads((smoke / "data.json").read_text())
    assert len(data["runs"]) == 8  # 2 tasks x 4 regimes x 1 seed
    for run in data["runs"]:  # the learning curve: every evaluation of the run, the last one its final score
        ev = [e for e in data["eval_curves"] if all(e[k] == run[k] for k in ("task", "regime", "seed"))]
        assert [e["step"] for e in ev] == [0, 20, 40]  # eval_every 20, 40 steps
        assert ev[-1]["loss_gap"] == run["loss_gap"] and ev[-1]["first_acc"] == run["first_acc"]  # exact: a copy
    assert all(math.isfinite(x) for x in all_numbers(data["influence"]))
    summary = json.loads((smoke / "summary.json").read_text())
    assert all(math.isfinite(x) for x in all_numbers(summary))
    claims = summary["claims"]
    assert len(claims) >= 3
    assert all(c["verdict"] in VERDICTS and c["measured"] for c in claims)
    assert 'id="claims"' in (smoke / "report.html").read_text()


@pytest.mark.one_thread
def test_rerun_reuses_runs_and_regenerates_same_report(smoke):
    before = {p: p.read_bytes() for p in (smoke / "report.md", smoke / "summary.json", smoke / "report.html")}
    mtimes = {p: p.stat().st_mtime_ns for p in (smoke / "runs").glob("*/model.safetensors")}
    assert main(["-q", "reproduce", "toy", "--scale", "smoke", "--out", str(smoke), "--workers", "1"]) == 0
    for p, content in before.items():
        assert p.read_bytes() == content, p.name
    assert {p: p.stat().st_mtime_ns for p in (smoke / "runs").glob("*/model.safetensors")} == mtimes


@pytest.mark.one_thread
def test_reproduction_gives_the_caller_its_thread_count_back(smoke):
    """In this process (--workers 1) every run trains on one torch thread; the caller's count comes back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert main(["-q", "reproduce", "toy", "--scale", "smoke", "--out", str(smoke), "--workers", "1"]) == 0
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_pipelines_pin_a_cpu_run_to_one_thread_whatever_the_callers_count(tmp_path):
    """The premise of the ``one_thread`` mark (pyproject.toml), which lets .ci/run's two-thread pass skip the smoke
    pipelines: a run trained by ``reproduce`` on a CPU records one thread in its threads.json, under a caller on 3."""
    from ntpflow.experiments.othello import SCALES
    from ntpflow.experiments.parallel import run_threads

    assert [run_threads("cpu", w) for w in (1, 2, 16)] == [1, 1, 1]
    assert SCALES["smoke"].threads == SCALES["paper-gpu-smoke"].threads == 1
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert main(["-q", "reproduce", "toy", "--scale", "smoke", "--tasks", "majority", "--regimes", "vanilla",
                     "--seeds", "0", "--no-replays", "--out", str(tmp_path / "toy"), "--workers", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    records = [json.loads(p.read_text()) for p in (tmp_path / "toy" / "runs").glob("*/threads.json")]
    assert len(records) == 1 and records[0]["segments"] == [[0, 1]]


def test_unknown_scale_is_a_clean_error(tmp_path, capsys):
    assert main(["reproduce", "toy", "--scale", "huge", "--out", str(tmp_path / "x")]) == 2
    assert "unknown scale" in capsys.readouterr().err
    assert main(["reproduce", "toy", "--regimes", "vanilla,bogus", "--out", str(tmp_path / "x")]) == 2
    assert "unknown toy regime(s) ['bogus']" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["reproduce", "toy", "--seeds", "0,3", "--out", str(tmp_path / "x")]) == 2
    assert "seeds [3] are not seeds of scale smoke" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["reproduce", "toy", "--seeds", "0,a", "--out", str(tmp_path / "x")]) == 2
    assert "--seeds takes comma-separated integers" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["reproduce", "toy", "--scale", "medium-momentum-cond", "--tasks", "majority",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "is for the task(s) ['cond_majority'], not ['majority']" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_the_control_of_conditioned_majority_is_the_third_pilots_choice():
    """Scale ``medium-momentum-cond`` trains what the third pilot trained (its file, committed before it ran) with
    the pilot's seed as one of its five: every setting but the evaluation and checkpoint cadence, which do not touch
    the training's bits."""
    import tomllib

    from ntpflow.experiments.toy import SCALES, run_configs

    pilot = tomllib.loads((ROOT / "docs/results/toy-momentum-pilot/pilot-cond-long.toml").read_text())
    (lr,) = pilot["grid"]["lr"]
    want = TrainConfig(**{**pilot["settings"], "lr": lr})
    scale = SCALES["medium-momentum-cond"]
    got = run_configs(scale, scale.tasks, ("vanilla",))
    assert [c.seed for c in got] == [0, 1, 2, 3, 4] and scale.tracked == ("vanilla",) and scale.tracked_seeds is None
    cadence = ("eval_every", "ckpt_every", "device")
    assert {k: v for k, v in got[0].to_dict().items() if k not in cadence} == \
        {k: v for k, v in want.to_dict().items() if k not in cadence}


@pytest.mark.one_thread
def test_no_replays_skips_the_tracked_replays_and_a_rerun_adds_them(tmp_path, capsys):
    out = tmp_path / "toy"
    args = ["-q", "reproduce", "toy", "--scale", "smoke", "--tasks", "majority", "--regimes", "myopic,vanilla",
            "--seeds", "0", "--out", str(out), "--workers", "1"]
    assert main([*args, "--no-replays"]) == 0
    data = json.loads((out / "data.json").read_text())
    assert data["seeds"] == [0]
    assert sorted(r["regime"] for r in data["runs"]) == ["myopic", "vanilla"]
    assert data["replays"] is False and data["influence"] == [] and data["tracked_seeds"] == []
    assert not list((out / "runs").glob("*/attribution"))
    claim_c = [c for c in json.loads((out / "summary.json").read_text())["claims"] if c["id"] == "c"]
    assert claim_c and all(c["verdict"] == "not testable at this scale" for c in claim_c)
    md = (out / "report.md").read_text()
    assert "tracked (vanilla) seeds none." in md and "| tracked sites | none (replays skipped) |" in md
    assert main(args) == 0  # the same command without the flag adds the replays to the finished runs
    data = json.loads((out / "data.json").read_text())
    assert data["replays"] is True and data["influence"]
    replayed = sorted(p.parent.name for p in (out / "runs").glob("*/attribution"))
    assert replayed == ["majority-myopic-s0", "majority-vanilla-s0"]  # smoke tracks every regime
    # the default is the exact account (on the run's readout set); the report says so, a folder holds one kind
    assert data["influence_read_at"] == "exact"
    specs = [json.loads((out / "runs" / r / "attribution" / "spec.json").read_text()) for r in replayed]
    n_eval = [Run.open(out / "runs" / r).cfg.n_eval for r in replayed]
    assert all(s["readout"] == min(256, n) and not s["midpoint"] for s, n in zip(specs, n_eval))
    assert ("| influence read | the exact account: a fixed readout set, each step's change split by a path integral "
            "| on each step's batch, ∇R at its start θ_t (the paper's reading) |") in (out / "report.md").read_text()
    before = (out / "data.json").read_bytes()
    assert main([*args, "--paper"]) == 2
    assert "holds an attribution with the exact account on a readout of" in capsys.readouterr().err
    assert (out / "data.json").read_bytes() == before


def test_paper_reading_needs_an_experiment_with_replays(tmp_path, capsys):
    assert main(["reproduce", "llm", "--paper", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--paper applies to the experiments with replays" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
