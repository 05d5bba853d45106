"""Progress without a terminal: stage lines on stderr (name, step/total, elapsed, ETA), throttled; a real command."""

import os
import re
import subprocess
import sys
from pathlib import Path

from test_cli import TINY_SET

from ntpflow.progress import StageLines, duration, progress_of


class Clock:
    """A clock that advances ``tick`` seconds at each reading."""

    def __init__(self, tick: float):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def lines_of(n_steps: int, tick: float, initial: int = 0) -> list[str]:
    out: list[str] = []
    for _ in StageLines(range(initial, n_steps), desc="run-a", total=n_steps, initial=initial, clock=Clock(tick),
                        write=out.append):
        pass
    return out


def counts(lines: list[str]) -> list[int]:
    return [int(re.search(r"step (\d+)/", line).group(1)) for line in lines]


def test_time_throttles_when_steps_are_fast():
    """1 s a step, 100 steps: a line once 30 s and 10 steps have passed, i.e. every 30 steps; start and end."""
    lines = lines_of(100, 1.0)
    assert counts(lines) == [0, 30, 60, 90, 100]
    assert lines[0] == "run-a: step 0/100 (0%), starting"
    # the clock reads once at the start, then once per step: at step 30, 30 s have elapsed and 70 steps remain
    assert lines[1] == "run-a: step 30/100 (30%), elapsed 30s, ETA 1m10s"
    assert lines[-1] == "run-a: step 100/100 (100%), done in 1m41s"


def test_steps_throttle_when_steps_are_slow():
    """100 s a step: time is never the limit, so a line every 10 % of the steps, never every step."""
    assert counts(lines_of(50, 100.0)) == [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50]


def test_a_long_loop_says_how_it_stands_every_ten_minutes():
    """60 s a step, 1000 steps: a tenth of the steps would be 100 minutes apart; a line every 10 steps (600 s) instead,
    its ETA from the steps so far."""
    lines = lines_of(1000, 60.0)
    assert counts(lines)[:4] == [0, 10, 20, 30] and counts(lines)[-2:] == [990, 1000]
    assert lines[1] == "run-a: step 10/1000 (1%), elapsed 10m00s, ETA 16h30m"


def test_short_loop_prints_start_and_end_only():
    assert counts(lines_of(1000, 0.001)) == [0, 1000]


def test_resumed_loop_counts_from_its_start():
    """Resumed at 40 of 100: the tenth is of the 60 steps left, the ETA from the steps done in this process."""
    lines = lines_of(100, 1.0, initial=40)
    assert lines[0] == "run-a: step 40/100 (40%), resuming"
    assert counts(lines) == [40, 70, 100]
    assert lines[1] == "run-a: step 70/100 (70%), elapsed 30s, ETA 30s"


def test_postfix_and_no_line_after_an_error():
    out: list[str] = []
    bar = StageLines(range(3), desc="r", total=3, clock=Clock(100.0), write=out.append, fraction=0.0)
    try:
        for i in bar:
            bar.set_postfix(loss=f"{i / 2:.2f}")
            if i == 1:
                raise KeyError("stop")
    except KeyError:
        pass
    assert out == ["r: step 0/3 (0%), starting", "r: step 1/3 (33%), elapsed 1m40s, ETA 3m20s, loss=0.00"]


def test_duration():
    assert [duration(s) for s in (0, 8.4, 59.6, 75, 3599, 3600, 4000)] == \
        ["0s", "8s", "1m00s", "1m15s", "59m59s", "1h00m", "1h06m"]


def test_progress_of_picks_by_terminal(capsys):
    """Under pytest stderr is no terminal: stage lines; disabled: nothing at all."""
    assert list(progress_of(range(3), desc="x", enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    assert list(progress_of(range(3), desc="x")) == [0, 1, 2]
    assert capsys.readouterr().err.splitlines() == ["x: step 0/3 (0%), starting", "x: step 3/3 (100%), done in 0s"]


def test_train_without_a_terminal_prints_stage_lines(tmp_path):
    """`ntpflow train` with stderr to a pipe (as under Slurm or nohup): stage lines name the run and step/total."""
    out = tmp_path / "maj-run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "ntpflow", "train", "--task", "majority", "--device", "cpu", "--out",
                          str(out), "--set", *TINY_SET], capture_output=True, text=True, timeout=300, env=env,
                         check=False)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert "maj-run: step 0/12 (0%), starting" in lines, res.stderr
    assert any(re.fullmatch(r"maj-run: step 12/12 \(100%\), done in \d+s, loss=\d\.\d{4}", x) for x in lines), \
        res.stderr
    assert any(x.startswith(f"finished {out}: eval_loss=") for x in lines), res.stderr
    assert res.stdout.strip() == str(out)


def test_jobs_write_their_own_stage_lines_only_without_a_terminal(monkeypatch, capsys):
    """run_jobs passes stages=True to each job without a terminal (its loops name their run), False on a terminal
    (the job bar alone) and with progress off."""
    from ntpflow.experiments import parallel

    seen = []
    record = lambda name, *, stages: seen.append(stages) or {"run_dir": f"runs/{name}"}  # noqa: E731
    for terminal, progress, expect in ((False, True, True), (True, True, False), (False, False, False)):
        monkeypatch.setattr(parallel, "on_terminal", lambda t=terminal: t)
        seen.clear()
        parallel.run_jobs(record, [("a",), ("b",)], 1, "jobs", progress)
        assert seen == [expect, expect]
    capsys.readouterr()


def test_a_run_named_run_is_logged_with_its_parent_folder():
    """Experiments keep runs in OUT/run and OUT/myopic/run: their log lines must tell them apart (hand-worked)."""
    from ntpflow.runs.config import TrainConfig
    from ntpflow.runs.run import Run

    cfg = TrainConfig(task="majority")
    assert [Run(Path(d), cfg).name for d in ("out/othello-6x6/run", "out/othello-6x6/myopic/run", "runs/maj-run")] \
        == ["othello-6x6/run", "myopic/run", "maj-run"]
    from ntpflow.experiments.parallel import finished_runs
    assert finished_runs({"run_dirs": ["out/x/run", "out/x/myopic/run"]}) == "finished x/run, myopic/run"
