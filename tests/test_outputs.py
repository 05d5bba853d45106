"""Outputs that combine and explain themselves: influence.parquet rows name their run; attribute ends with a summary
line whose balance ratio is the one summary.json implies."""

import json
import logging

import pytest

from ntpflow import TrainConfig
from ntpflow.model.sites import Site
from ntpflow.runs.training import train

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2, "steps": 12, "batch_size": 32, "n_train": 256, "n_eval": 256,
        "eval_every": 6, "ckpt_every": 6, "log_every": 4, "regime": "myopic", "seed": 3}


def test_influence_rows_are_self_describing_and_attribute_summarises(tmp_path, caplog):
    import pyarrow.parquet as pq

    from ntpflow.replay.attribution import attribute
    from ntpflow.replay.spec import AttributionSpec

    train(TrainConfig(**TINY), tmp_path / "run", progress=False)
    with caplog.at_level(logging.INFO, logger="ntpflow.replay"):
        spec = AttributionSpec([Site(1, 3), Site(0, 5)], ["is_majority_<0>"], reading="paper")
        out = attribute(tmp_path / "run", spec, out_dir=tmp_path / "a", progress=False)
    table = pq.read_table(out / "influence.parquet")
    assert {"task", "regime", "seed"} <= set(table.column_names)
    rows = table.select(["task", "regime", "seed"]).to_pylist()
    assert rows and all(r == {"task": "majority", "regime": "myopic", "seed": 3} for r in rows)
    line = next(m for m in caplog.messages if "attributed" in m)
    assert line.startswith(f"{tmp_path.name}/run: attributed 2 sites × 1 features over 12 steps;")  # names its run
    assert caplog.messages[-1].startswith(f"{tmp_path.name}/run: conditioning, centred: κ (adam)")
    probes = json.loads((out / "summary.json").read_text())["probes"]
    ratios = sorted(p["adam_full"] / p["R0_minus_RT_eval"] for p in probes if p["mismatch"] == "paper")
    assert f"median {ratios[len(ratios) // 2]:.3g} over {len(ratios)} probes" in line


@pytest.mark.parametrize("page", ["docs/outputs.md", "docs/paper.md"])
def test_docs_stand_alone(page):
    """The docs name no file outside the repository."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / page).read_text()
    assert "PAPER.md" not in text and "../shared" not in text and "/work/" not in text
