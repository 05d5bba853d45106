"""``ntpflow breakdown``: one step's component influences split over the parameter tensors, against the exact
account's own rows for the same steps (an independent construction: autograd path gradients and moments summed from
``decompose``, against the tracker's forward-mode tangents and its own moments)."""

import json

import pyarrow.parquet as pq
import pytest

from ntpflow import Site, TrainConfig
from ntpflow.cli import main
from ntpflow.replay.attribution import attribute
from ntpflow.replay.breakdown import breakdown, parse_steps
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.training import train

TINY = dict(task="majority", n_layer=2, d_model=32, n_head=2, steps=12, batch_size=32, n_train=256, n_eval=128,
            eval_every=6, ckpt_every=4, log_every=2, device="cpu")
SITE, FEATURE = Site(1, 3), "is_majority_<0>"


@pytest.fixture(scope="module", params=[{}, {"optimizer": "sgd", "momentum": 0.9, "lr": 0.5}], ids=["adam", "momentum"])
def attributed(request, tmp_path_factory):
    run = tmp_path_factory.mktemp("bd") / "run"
    train(TrainConfig(**TINY, **request.param), run, progress=False)
    att = attribute(run, AttributionSpec([SITE], [FEATURE], readout=64), device="cpu", progress=False)
    return run, pq.read_table(att / "influence.parquet").to_pylist()


@pytest.mark.parametrize("warm", [20, 1])
def test_tensor_sums_equal_the_exact_accounts_rows(attributed, tmp_path, warm):
    """Σ over tensors of each component = the attribution's row of that step (optimizer's reading and SGD), to
    float32 rounding; the full of the optimizer's reading = the exact change (its residual within 8-point Gauss);
    ``warm=1`` starts each step's moments at the checkpoint before it (4 for step 5, 8 for step 9): short by
    β^(steps summed), recorded, so only the SGD reading (no moments) and the full step are compared there."""
    run, rows = attributed
    out = breakdown(run, [5, 9], [SITE], [FEATURE], readout=64, warm=warm, out_dir=tmp_path / "bd")
    summary = json.loads((out / "summary.json").read_text())
    table = pq.read_table(out / "breakdown.parquet").to_pylist()
    own = summary["optimizer"]
    assert {e["reading"] for e in summary["entries"]} == {own, "sgd"}
    for e in summary["entries"]:
        r0 = next(r["value"] for r in rows if r["step"] == 0 and r["component"] == "risk"
                  and r["mismatch"] == e["mismatch"] and r["feature_type"] == -1)
        truncation = e["truncation"]
        start = max(c for c in (0, 4, 8) if c <= max(0, e["step"] - warm))  # the checkpoint each window starts from
        assert truncation == (0.0 if start == 0 else pytest.approx(0.9 ** (e["step"] - start + 1)))
        exact = e["reading"] == "sgd" or truncation == 0
        for c, v in e["components"].items():
            (ref,) = [r["value"] for r in rows if (r["step"], r["mismatch"], r["optimizer"], r["component"],
                                                    r["feature_type"]) == (e["step"], e["mismatch"], e["reading"], c, -1)]
            if exact:
                assert v["total"] == pytest.approx(ref, abs=1e-5 * r0), (c, e["reading"])
            assert v["total"] == pytest.approx(sum(r["value"] for r in table if (
                r["step"], r["mismatch"], r["reading"], r["component"]) == (e["step"], e["mismatch"], e["reading"], c)))
        if e["reading"] == own:
            assert abs(e["residual"]) <= 1e-4 * r0


def test_parse_steps_and_bad_input(attributed, tmp_path, capsys):
    assert parse_steps("9,2-4", 12) == [2, 3, 4, 9]
    run, _ = attributed
    for bad, fragment in (("12", "outside the run's steps 0..11"), ("a-b", "--steps takes STEP")):
        assert main(["breakdown", str(run), "--steps", bad, "--sites", "1:3", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()


def test_a_plain_sgd_run_is_broken_down_in_its_one_reading(tmp_path):
    """Plain SGD (momentum 0): one reading, lr · g_c, whose full is the real step: the tensors' sums equal the exact
    account's rows and the full its exact change."""
    run = tmp_path / "run"
    train(TrainConfig(**{**TINY, "steps": 6, "ckpt_every": 3}, optimizer="sgd", lr=0.5), run, progress=False)
    rows = pq.read_table(attribute(run, AttributionSpec([SITE], [FEATURE], readout=64), device="cpu", progress=False)
                         / "influence.parquet").to_pylist()
    summary = json.loads((breakdown(run, [4], [SITE], [FEATURE], readout=64, out_dir=tmp_path / "bd")
                          / "summary.json").read_text())
    assert summary["optimizer"] == "sgd" and {e["reading"] for e in summary["entries"]} == {"sgd"}
    for e in summary["entries"]:
        r0 = next(r["value"] for r in rows if r["step"] == 0 and r["component"] == "risk"
                  and r["mismatch"] == e["mismatch"] and r["feature_type"] == -1)
        for c, v in e["components"].items():
            (ref,) = [r["value"] for r in rows if (r["step"], r["mismatch"], r["optimizer"], r["component"],
                                                    r["feature_type"]) == (4, e["mismatch"], "sgd", c, -1)]
            assert v["total"] == pytest.approx(ref, abs=1e-5 * r0)
        assert abs(e["residual"]) <= 1e-4 * r0
