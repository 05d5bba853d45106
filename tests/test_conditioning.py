"""How well-posed a split is (``ntpflow.replay.conditioning``) and SGD with momentum, the optimizer under which the
split is the step's own: κ against hand-worked cases and a recomputation from influence.parquet, a momentum run
trained, resumed and attributed."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ntpflow import Site, TrainConfig
from ntpflow.replay.attribution import attribute
from ntpflow.replay.conditioning import condition, kappa, step_kappas
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.run import Run
from ntpflow.runs.training import ScheduledSGD, make_optimizer, train

TINY = dict(task="majority", n_layer=1, d_model=32, n_head=2, steps=12, batch_size=32, n_train=256, n_eval=128,
            eval_every=6, ckpt_every=4, log_every=2, device="cpu")


def test_kappa_by_hand():
    assert kappa([3.0, -2.0, 0.5], 1.5) == pytest.approx(5.5 / 1.5)
    assert kappa([1.0, 0.0, 0.5], 1.5) == pytest.approx(1.0)  # no cancellation
    assert kappa([1.0, -1.0, 0.0], 0.0) is None


def test_step_kappas_sum_over_steps_before_dividing():
    """Two steps: step 0 direct 2, shared −1 (full 1); step 1 direct −1, shared 2 (full 1): κ_steps = 6 / 2 = 3,
    while the totals (direct 1, shared 1, full 2) give κ = 1."""
    rows = []
    for step, (d, s) in enumerate(((2.0, -1.0), (-1.0, 2.0))):
        for comp, v in (("direct", d), ("pre_cached", 0.0), ("shared", s), ("full", d + s), ("risk", 9.0)):
            rows.append({"step": step, "layer": 1, "pos": 3, "feature": "f", "feature_type": -1, "mismatch": "paper",
                         "component": comp, "optimizer": "adam" if comp != "risk" else "none", "value": v})
    steps = step_kappas(pa.Table.from_pylist(rows))
    assert steps[(1, 3, "f", -1, "paper", "adam")] == pytest.approx(3.0)
    entry = {"adam_direct": 1.0, "adam_pre_cached": 0.0, "adam_shared": 1.0, "adam_full": 2.0,
             "sgd_direct": 0.5, "sgd_pre_cached": 0.0, "sgd_shared": -0.1, "sgd_full": 0.4}
    out = condition(entry, steps, (1, 3, "f", -1, "paper"), "adam")
    assert out["kappa_adam"] == pytest.approx(1.0) and out["kappa_steps_adam"] == pytest.approx(3.0)
    assert out["kappa_sgd"] == pytest.approx(0.6 / 0.4) and out["kappa_steps_sgd"] is None  # no sgd steps given
    assert out["signs_agree"] == {"direct": True, "pre_cached": True, "shared": False}


def test_momentum_config_is_checked_and_adam_keeps_its_hash():
    assert TrainConfig(**TINY).hash() == TrainConfig(**TINY, optimizer="adam").hash()
    assert TrainConfig(**TINY, optimizer="sgd", momentum=0.9).hash() != TrainConfig(**TINY, optimizer="sgd").hash()
    assert TrainConfig(**TINY, optimizer="sgd", momentum=0.9).own_rows == "momentum"
    assert TrainConfig(**TINY, optimizer="sgd").own_rows == "sgd"
    with pytest.raises(ValueError, match="momentum applies to optimizer=sgd"):
        TrainConfig(**TINY, momentum=0.9)
    with pytest.raises(ValueError, match="momentum must lie in"):
        TrainConfig(**TINY, optimizer="sgd", momentum=1.0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        TrainConfig(**TINY, optimizer="adamw")


@pytest.fixture(scope="module")
def momentum_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("momentum") / "run"
    train(TrainConfig(**TINY, optimizer="sgd", momentum=0.9, lr=0.5), out, progress=False)
    return out


def test_a_momentum_run_resumes_to_the_same_bits(momentum_run, tmp_path):
    """Killed after its step-4 checkpoint (the later files removed), the run resumes from the momentum buffers
    saved there and ends in the same weights."""
    run = tmp_path / "run"
    shutil.copytree(momentum_run, run)
    meta = json.loads((run / "ckpt" / "step_000004.json").read_text())
    assert meta["momentum"] is True and meta["adam_step"] == 0
    for f in [*(run / "ckpt").glob("step_000008.*"), run / "DONE", *run.glob("model.*")]:
        f.unlink()
    train(Run.open(run).cfg, run, progress=False)
    a, b = Run.open(momentum_run).weights("final"), Run.open(run).weights("final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_scheduled_sgd_steps_at_the_schedules_rates():
    """SGD with momentum 0.5 on a warmup-cosine schedule: each step moves the weights by lr_t · m_t with m_t = 0.5
    m_{t-1} + g_t (summed by hand), the rate a replay reads before the step is the step's, and a fresh optimizer
    loaded from the state dict goes on at the next step's rate."""
    cfg = TrainConfig(**{**TINY, "steps": 6}, optimizer="sgd", momentum=0.5, lr=0.1, warmup=2, decay="cosine",
                      final_lr_frac=0.0)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = ScheduledSGD([p], cfg, momentum=0.5)
    m = torch.zeros(3, dtype=torch.float64)
    for s in range(6):
        assert opt.param_groups[0]["lr"] == cfg.lr_at(s)
        g = torch.full((3,), float(s + 1), dtype=torch.float64)
        m = 0.5 * m + g
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        assert torch.allclose(before - p.detach(), cfg.lr_at(s) * m, rtol=4 * torch.finfo(torch.float64).eps, atol=0)
        fresh = ScheduledSGD([torch.nn.Parameter(p.detach().clone())], cfg, momentum=0.5)
        fresh.load_state_dict(opt.state_dict())
        assert fresh.param_groups[0]["lr"] == cfg.lr_at(s + 1)


@pytest.fixture(scope="module")
def scheduled_momentum_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scheduled") / "run"
    cfg = TrainConfig(**TINY, optimizer="sgd", momentum=0.9, lr=0.5, warmup=3, decay="cosine")
    train(cfg, out, progress=False)
    return out


def test_a_scheduled_momentum_run_resumes_to_the_same_bits_and_adds_up(scheduled_momentum_run, tmp_path):
    """Killed after its step-4 checkpoint, a warmup-cosine momentum run resumes at the schedule's rate (the step
    count restored from the checkpoint) and ends in the same weights; its attribution's momentum rows add up to the
    exact change (residual ≤ 1% of R_H(θ_0))."""
    assert isinstance(make_optimizer(Run.open(scheduled_momentum_run).load_model("init"),
                                     Run.open(scheduled_momentum_run).cfg), ScheduledSGD)
    run = tmp_path / "run"
    shutil.copytree(scheduled_momentum_run, run)
    for f in [*(run / "ckpt").glob("step_000008.*"), run / "DONE", *run.glob("model.*")]:
        f.unlink()
    train(Run.open(run).cfg, run, progress=False)
    a, b = Run.open(scheduled_momentum_run).weights("final"), Run.open(run).weights("final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = attribute(run, AttributionSpec([Site(1, 3)], ["is_majority_<0>"], readout=64), device="cpu",
                    progress=False)
    for e in json.loads((out / "summary.json").read_text())["probes"]:
        assert abs(e["residual"]) <= 0.01 * e["R0_eval"]


def test_a_momentum_run_attributes_with_both_readings_that_add_up(momentum_run, tmp_path):
    """The default attribute of a momentum run: its own rows (``momentum``) add up to the exact change (residual
    ≤ 1% of R_H(θ_0)), the SGD direction beside them; κ of each reading equals a recomputation from influence.parquet
    (totals and steps), signs_agree compares the two."""
    run = tmp_path / "run"
    shutil.copytree(momentum_run, run)
    out = attribute(run, AttributionSpec([Site(1, 3), Site(1, 12)], ["is_majority_<0>"], readout=64),
                    device="cpu", progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["own_rows"] == "momentum"
    rows = pq.read_table(out / "influence.parquet").to_pylist()
    for e in summary["probes"]:
        assert e["momentum_direct"] + e["momentum_pre_cached"] + e["momentum_shared"] == pytest.approx(
            e["momentum_full"], rel=1e-9, abs=1e-12 * e["R0_eval"])
        assert abs(e["residual"]) <= 0.01 * e["R0_eval"]
        assert e["residual"] == pytest.approx(e["momentum_full"] - e["change"], abs=1e-9 * e["R0_eval"])
        mine = [r for r in rows if (r["layer"], r["pos"], r["feature"], r["mismatch"], r["feature_type"])
                == (e["layer"], e["pos"], e["feature"], e["mismatch"], -1)]
        for o in ("momentum", "sgd"):
            total = {c: sum(r["value"] for r in mine if r["optimizer"] == o and r["component"] == c)
                     for c in ("direct", "pre_cached", "shared", "full")}
            parts = abs(total["direct"]) + abs(total["pre_cached"]) + abs(total["shared"])
            assert e[f"kappa_{o}"] == pytest.approx(parts / abs(total["full"]), rel=1e-9)
            by_step = sum(abs(r["value"]) for r in mine if r["optimizer"] == o
                          and r["component"] in ("direct", "pre_cached", "shared"))
            full_steps = sum(abs(r["value"]) for r in mine if r["optimizer"] == o and r["component"] == "full")
            assert e[f"kappa_steps_{o}"] == pytest.approx(by_step / full_steps, rel=1e-9)
            assert e[f"kappa_{o}"] >= 1 - 1e-9
        assert e["signs_agree"] == {c: (e[f"momentum_{c}"] > 0) == (e[f"sgd_{c}"] > 0)
                                    for c in ("direct", "pre_cached", "shared")}


def test_attribute_ends_with_the_answer_marked_useful_or_useless(momentum_run, tmp_path, capsys, caplog):
    """The CLI's closing lines: per site × feature and mismatch the change and each component's share of it (the run's
    own reading / the exact change, recomputed here from summary.json), κ, and the task's NTP-useful mark, which
    summary.json and every influence row carry too."""
    from ntpflow.cli import main
    from ntpflow.tasks import make_task

    run = tmp_path / "run"
    shutil.copytree(momentum_run, run)
    with caplog.at_level("INFO"):
        assert main(["attribute", str(run), "--sites", "1:3,1:12", "--features", "is_majority_<0>"]) == 0
    assert capsys.readouterr().out.strip() == str(run / "attribution")  # stdout: the folder; the answer: the log
    out = "\n".join(caplog.messages)
    summary = json.loads((run / "attribution" / "summary.json").read_text())
    task = make_task("majority")
    j = task.feature_names.index("is_majority_0")
    for e in summary["probes"]:
        useful = bool(task.useful[e["pos"], j])
        assert e["useful"] is useful
        for c in ("direct", "pre_cached", "shared"):
            assert e["shares"][c] == pytest.approx(e[f"momentum_{c}"] / e["change"], rel=1e-12)
        label = {"centred": "R_c", "paper": "R"}[e["mismatch"]]
        line = next(x for x in out.splitlines() if x.strip().startswith(f"⟨1, {e['pos']}⟩ is_majority_0")
                    and f", {label} change" in x)
        assert ("NTP-useful" if useful else "NTP-useless") in line
        assert f"direct {e['shares']['direct']:.2f} + pre-cached {e['shares']['pre_cached']:.2f}" in line
    rows = pq.read_table(run / "attribution" / "influence.parquet").to_pylist()
    assert {(r["pos"], r["useful"]) for r in rows} == {(p, bool(task.useful[p, j])) for p in (3, 12)}
