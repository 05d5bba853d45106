"""Training records its torch thread count per range of steps; resumes continue it, replays follow it, and the
caller's count is restored."""

import json

import pytest
import torch

from ntpflow.files import SimulatedKill, load_tensors
from ntpflow.model.sites import Site
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.threads import continue_threads, follow_threads, kept_threads
from ntpflow.runs.training import train

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "steps": 8, "batch_size": 32, "n_train": 512, "n_eval": 64,
        "eval_every": 4, "ckpt_every": 4, "log_every": 4}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_resume_continues_the_recorded_count_and_an_explicit_one_starts_a_segment(tmp_path, threads):
    cpu = torch.device("cpu")
    record = tmp_path / "threads.json"
    torch.set_num_threads(3)
    with kept_threads():
        torch.set_num_threads(2)
        assert continue_threads([tmp_path], 0, cpu) == 2  # fresh: this process's count
        torch.set_num_threads(1)
        assert continue_threads([tmp_path], 400, cpu) == 2  # resumed: the recorded count, not this process's
        assert torch.get_num_threads() == 2
        assert continue_threads([tmp_path], 600, cpu, threads=1) == 1  # explicit: a new segment
        torch.set_num_threads(3)
        assert continue_threads([tmp_path], 900, cpu) == 1
        assert continue_threads([tmp_path], 800, cpu, threads=2) == 2  # a resume from 800 redoes 800..
        assert json.loads(record.read_text()) == {"device": "cpu", "segments": [[0, 2], [600, 1], [800, 2]]}
    assert torch.get_num_threads() == 3  # the count kept_threads found
    record.write_text(json.dumps({"device": "cuda", "segments": [[0, 1]]}))
    torch.set_num_threads(2)
    assert continue_threads([tmp_path], 50, cpu) == 2  # trained on a GPU: nothing to continue on a CPU


def test_follow_sets_each_segments_count_and_restores(tmp_path, threads):
    (tmp_path / "threads.json").write_text(json.dumps({"device": "cpu", "segments": [[5, 2], [10, 1]]}))
    torch.set_num_threads(3)
    seen = {}
    with follow_threads(tmp_path, torch.device("cpu")) as at:
        for step in (0, 4, 5, 9, 10, 20):
            at(step)
            seen[step] = torch.get_num_threads()
    assert seen == {0: 3, 4: 3, 5: 2, 9: 2, 10: 1, 20: 1}  # before the first segment: not recorded, left alone
    assert torch.get_num_threads() == 3
    (tmp_path / "threads.json").write_text(json.dumps({"device": "cuda", "segments": [[0, 1]]}))
    with follow_threads(tmp_path, torch.device("cpu")) as at:  # trained on a GPU: threads do not matter
        at(0)
        assert torch.get_num_threads() == 3


def test_an_interrupted_run_resumed_by_a_process_with_another_count_ends_in_the_same_bits(tmp_path, threads,
                                                                                          monkeypatch):
    cfg = TrainConfig(**{**TINY, "steps": 12})
    torch.set_num_threads(2)
    train(cfg, tmp_path / "whole", progress=False)
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")  # killed after its step-4 checkpoint
    with pytest.raises(SimulatedKill):
        train(cfg, tmp_path / "cut", progress=False)
    monkeypatch.delenv("NTPFLOW_FAULT")
    torch.set_num_threads(1)
    train(cfg, tmp_path / "cut", progress=False)
    assert torch.get_num_threads() == 1  # the caller's count, restored
    assert json.loads((tmp_path / "cut" / "threads.json").read_text()) == {"device": "cpu", "segments": [[0, 2]]}
    whole, cut = (load_tensors(tmp_path / d / "model.safetensors") for d in ("whole", "cut"))
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)


def test_a_run_extended_with_another_thread_count_replays_bit_for_bit(tmp_path, threads):
    torch.set_num_threads(2)
    train(TrainConfig(**TINY), tmp_path / "run", progress=False)
    train(TrainConfig(**{**TINY, "steps": 16}), tmp_path / "run", progress=False, threads=1)  # steps 8.. on 1
    record = json.loads((tmp_path / "run" / "threads.json").read_text())
    assert record == {"device": "cpu", "segments": [[0, 2], [8, 1]]}
    torch.set_num_threads(3)
    attribute(tmp_path / "run", AttributionSpec([Site(1, 3)], ["is_majority_<0>"], sgd_rows=False),
              out_dir=tmp_path / "a", progress=False)  # raises if the replay's weights differ from the run's in any bit
    assert torch.get_num_threads() == 3
