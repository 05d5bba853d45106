"""Training records its torch thread count per range of steps; replays follow the record and restore the caller's."""

import json

import pytest
import torch

from ntpflow.config import TrainConfig
from ntpflow.replay import attribute
from ntpflow.sites import Site
from ntpflow.threads import follow_threads, record_threads
from ntpflow.training import train

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "steps": 8, "batch_size": 32, "n_train": 512, "n_eval": 64,
        "eval_every": 4, "ckpt_every": 4, "log_every": 4}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_segments_are_recorded_merged_and_cut_at_a_resume(tmp_path, threads):
    cpu = torch.device("cpu")
    torch.set_num_threads(2)
    record_threads([tmp_path], 0, cpu)
    record_threads([tmp_path], 400, cpu)  # same count: the segment goes on
    torch.set_num_threads(1)
    record_threads([tmp_path], 600, cpu)
    record_threads([tmp_path], 900, cpu)
    torch.set_num_threads(2)
    record_threads([tmp_path], 800, cpu)  # a resume from 800 redoes 800..: the segment from 900 is gone
    assert json.loads((tmp_path / "threads.json").read_text()) == {"device": "cpu",
                                                                   "segments": [[0, 2], [600, 1], [800, 2]]}


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


def test_a_run_resumed_with_another_thread_count_replays_bit_for_bit(tmp_path, threads):
    torch.set_num_threads(2)
    train(TrainConfig(**TINY), tmp_path / "run", progress=False)
    torch.set_num_threads(1)
    train(TrainConfig(**{**TINY, "steps": 16}), tmp_path / "run", progress=False)  # extended: steps 8.. on 1 thread
    record = json.loads((tmp_path / "run" / "threads.json").read_text())
    assert record == {"device": "cpu", "segments": [[0, 2], [8, 1]]}
    torch.set_num_threads(3)
    attribute(tmp_path / "run", [Site(1, 3)], ["is_majority_<0>"], out_dir=tmp_path / "a", progress=False,
              sgd_rows=False)  # raises if the replay's weights differ from the run's in any bit
    assert torch.get_num_threads() == 3
