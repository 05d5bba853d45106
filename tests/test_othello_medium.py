"""Othello at a trainable scale (issue 32): the token-only training set, the learning-rate schedule, resuming and
replaying a scheduled Othello run, and typed replays of a token-only training set."""

import hashlib
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ntpflow.files import SimulatedKill, load_tensors
from ntpflow.model.sites import Site
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.run import Run
from ntpflow.runs.training import ScheduledAdam, make_optimizer, train
from ntpflow.tasks.base import Batch, concat_batches
from ntpflow.tasks.othello import Othello

TINY = {"task": "othello", "n_layer": 2, "d_model": 32, "n_head": 2, "batch_size": 16, "steps": 12, "lr": 3e-3,
        "n_train": 128, "n_eval": 64, "eval_every": 6, "ckpt_every": 4, "log_every": 2, "device": "cpu"}


def test_training_set_holds_the_tokens_of_the_full_games_only():
    task = Othello()
    train, evals = task.make_datasets(300, 50, seed=5)
    full = task.sample(300, np.random.default_rng([5, 0]))  # the games the training set was drawn as
    assert train.features is None and train.legal is None and train.feature_types is None
    assert np.array_equal(train.tokens, full.tokens) and np.array_equal(train.loss_mask, full.loss_mask)
    assert train.tokens.dtype == np.int64
    per_game = (train.tokens.nbytes + train.loss_mask.nbytes) / len(train)
    assert per_game == 61 * 8 + 61  # int64 tokens and a bool mask
    ev = task.sample(50, np.random.default_rng([5, 1]))
    assert np.array_equal(evals.features, ev.features) and np.array_equal(evals.feature_types, ev.feature_types)
    assert np.array_equal(evals.legal, ev.legal)
    # a token-only batch indexes and concatenates as one; mixing it with a full batch is refused
    assert np.array_equal(concat_batches([train[:10], train[10:20]]).tokens, train.tokens[:20])
    with pytest.raises(ValueError, match="token-only"):
        concat_batches([train[:2], full[:2]])
    with pytest.raises(ValueError, match="token-only"):
        Batch(tokens=train.tokens, loss_mask=train.loss_mask, legal=None, features=None,
              feature_types=full.feature_types)


def test_lr_schedule_values_by_hand():
    cfg = TrainConfig(steps=11, lr=1.0, warmup=2, decay="linear", final_lr_frac=0.1)
    # warmup: (step+1)/2 at steps 0, 1; then linear from 1 at step 2 to 0.1 at step 10
    want = [0.5, 1.0] + [1 - 0.9 * (s - 2) / 8 for s in range(2, 11)]
    assert [cfg.lr_at(s) for s in range(11)] == pytest.approx(want, abs=1e-15)
    cos = TrainConfig(steps=5, lr=2.0, decay="cosine", final_lr_frac=0.0)
    assert [cos.lr_at(s) for s in range(5)] == pytest.approx([2 * 0.5 * (1 + math.cos(math.pi * s / 4))
                                                              for s in range(5)], abs=1e-15)
    assert [TrainConfig(lr=0.3, warmup=4).lr_at(s) for s in (0, 3, 100)] == pytest.approx([0.075, 0.3, 0.3])
    assert not TrainConfig().scheduled and TrainConfig(warmup=1).scheduled and TrainConfig(decay="cosine").scheduled
    for bad in ({"decay": "step"}, {"warmup": -1}, {"final_lr_frac": 1.5}):
        with pytest.raises(ValueError):
            TrainConfig(**bad)


def test_schedule_off_keeps_the_hash_of_configs_from_before_it():
    cfg = TrainConfig(task="othello", steps=7)
    d = {k: v for k, v in cfg.to_dict().items()
         if k not in ("device", "log_every", "warmup", "decay", "final_lr_frac", "board_size", "optimizer", "momentum",
                      "task_args")}
    assert cfg.hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    assert TrainConfig(task="othello", steps=7, warmup=2).hash() != cfg.hash()


def test_scheduled_adam_steps_at_the_schedules_rates():
    cfg = TrainConfig(steps=6, lr=0.1, warmup=2, decay="cosine", final_lr_frac=0.0)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = ScheduledAdam([p], cfg, betas=(0.0, 0.999), eps=1e-30)
    for s in range(6):
        assert opt.param_groups[0]["lr"] == cfg.lr_at(s)  # the rate a replay reads before the step
        before = p.detach().clone()
        p.grad = torch.ones(3, dtype=torch.float64)
        opt.step()
        # beta1 = 0, a constant gradient: Adam's step is lr * g / sqrt(v_hat) = lr exactly (eps negligible)
        assert torch.allclose(before - p.detach(), torch.full((3,), cfg.lr_at(s), dtype=torch.float64), rtol=1e-12)
        fresh = ScheduledAdam([torch.nn.Parameter(p.detach().clone())], cfg, betas=(0.0, 0.999))
        fresh.load_state_dict(opt.state_dict())
        assert fresh.param_groups[0]["lr"] == cfg.lr_at(s + 1)


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory):
    cfg = TrainConfig(**TINY, warmup=3, decay="cosine")
    out = tmp_path_factory.mktemp("sched") / "run"
    train(cfg, out, progress=False)
    return cfg, out


def test_a_killed_scheduled_run_resumes_to_the_same_bits(scheduled_run, tmp_path, monkeypatch):
    cfg, out = scheduled_run
    assert isinstance(make_optimizer(Run(out, cfg).load_model("init"), cfg), ScheduledAdam)
    other = tmp_path / "run"
    monkeypatch.setenv("NTPFLOW_FAULT", "train:after_checkpoint")
    with pytest.raises(SimulatedKill):
        train(cfg, other, progress=False)
    monkeypatch.delenv("NTPFLOW_FAULT")
    assert not Run(other, cfg).done
    train(cfg, other, progress=False)
    a, b = load_tensors(Run(out, cfg).weights_path("final")), load_tensors(Run(other, cfg).weights_path("final"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    unscheduled = TrainConfig(**TINY)
    train(unscheduled, tmp_path / "plain", progress=False)
    c = load_tensors(Run(tmp_path / "plain", unscheduled).weights_path("final"))
    assert not torch.equal(a["wte"], c["wte"])  # the schedule does change training
    with pytest.raises(ValueError, match="schedule"):
        train(TrainConfig(**{**cfg.to_dict(), "steps": 16}), out, progress=False)


def test_replays_of_a_scheduled_token_only_run(scheduled_run, tmp_path):
    """The replay reproduces the scheduled run bit for bit (attribute checks it); in the paper's reading the per-type
    rows are labelled from each batch's tokens, exactly the types the full games have; in the exact account from the
    readout set."""
    cfg, out = scheduled_run
    sites, squares = [Site(1, 20)], ["sq_C3", "sq_D4"]
    plain = attribute(out, AttributionSpec(sites, squares, sgd_rows=False, reading="paper"),
                      out_dir=tmp_path / "plain", progress=False)
    exact = attribute(out, AttributionSpec(sites, squares, sgd_rows=False, readout=16),
                      out_dir=tmp_path / "exact", progress=False)
    for folder in (plain, exact):
        table = pq.read_table(folder / "influence.parquet").to_pandas()
        assert {1, 2} <= set(table["feature_type"].unique())
    # the types of the rows of step 0: those of the full games of step 0's batch at position 20
    from ntpflow.runs.data import DataOrder
    idx = DataOrder(cfg.seed, cfg.n_train, cfg.batch_size)(0).numpy()
    full = Othello().sample(cfg.n_train, np.random.default_rng([cfg.seed, 0]))
    table = pq.read_table(plain / "influence.parquet").to_pandas()
    risk = table[(table.step == 0) & (table.component == "risk") & (table.feature == "sq_D4")]
    want = set(np.unique(full.feature_types[idx, 20, Othello().feature_names.index("sq_D4")]).tolist())
    assert set(risk["feature_type"].unique()) - {-1} == want


def test_token_only_set_without_annotate_needs_the_exact_account(scheduled_run, tmp_path, monkeypatch):
    _, out = scheduled_run
    monkeypatch.delattr(Othello, "annotate")
    with pytest.raises(ValueError, match="per-type rows need the exact account's readout"):
        attribute(out, AttributionSpec([Site(1, 20)], ["sq_C3"], reading="paper"),
                  out_dir=tmp_path / "a", progress=False)


# ---------------------------------------------------------------------------------------------- the fragility test


@pytest.fixture(scope="module")
def pairs():
    from ntpflow.experiments.othello_fragility import find_pairs
    return find_pairs(40, 20, 3, seed=3, per_prefix=3)


def _replay(tokens: np.ndarray, t: int):
    """(own, opp) after the t game tokens of one history, by the engine's move-by-move rules (independent of the
    search's expansion)."""
    from ntpflow.tasks.othello_engine import START_OPP, START_OWN, play
    own, opp = np.array([START_OWN]), np.array([START_OPP])
    for tok in tokens[1:t + 1]:
        own, opp = play(own, opp, np.array([int(tok) - 3]))
    return own, opp


def test_pairs_share_legal_moves_and_stones_and_differ_where_their_kind_says(pairs):
    from ntpflow.tasks.othello_engine import bitboard_to_mask, legal_moves, square_types
    assert len(pairs) > 10 and set(pairs.kind) == {"useless", "useful"} and pairs.t == 23
    assert (pairs.tokens[:, :, pairs.t + 1:] == 2).all()  # padded with pass after the history
    for k in range(len(pairs)):
        (oa, pa), (ob, pb) = (_replay(pairs.tokens[k, i], pairs.t) for i in (0, 1))
        assert legal_moves(oa, pa) == legal_moves(ob, pb) and (oa | pa) == (ob | pb) and oa != ob
        for i, (o, p) in enumerate(((oa, pa), (ob, pb))):
            board = bitboard_to_mask(o)[0].astype(np.int8) - bitboard_to_mask(p)[0].astype(np.int8)
            assert np.array_equal(board, pairs.boards[k, i])
            assert np.array_equal(square_types(o, p)[0], pairs.types[k, i])
        diff = pairs.differ[k]
        assert diff.any()
        types = pairs.types[k][:, diff]
        assert (pairs.kind[k] == "useful") == bool((types == 2).any())
        if pairs.kind[k] == "useless":
            assert (types == 1).all()


def test_fragility_measures_on_a_tiny_model(pairs):
    from ntpflow.experiments.othello_fragility import _which_board, fragility_section, measure
    from ntpflow.model.gpt import GPT
    from ntpflow.probes import fit_probes
    from ntpflow.runs.probe import collect_resid
    from ntpflow.runs.run import model_config
    task = Othello()
    model = GPT(model_config(TrainConfig(task="othello", n_layer=2, d_model=32, n_head=2), task), seed=0)
    ev = task.sample(200, np.random.default_rng(0))
    probes = fit_probes(collect_resid(model, torch.as_tensor(ev.tokens)), torch.as_tensor(ev.features),
                        positions=[pairs.t], feature_names=task.feature_names)
    rows = measure(model, probes, pairs)
    assert len(rows) == 3 * 2 and {r["kind"] for r in rows} == {"useless", "useful"}
    # the probe accuracy by hand for layer 1, useful pairs: ProbeSet.predict on the full residual grid
    resid = collect_resid(model, torch.as_tensor(pairs.tokens.reshape(-1, 61)))  # [L+1, 2n, T, d]
    pred = probes.predict(resid)[1, :, pairs.t].reshape(len(pairs), 2, 64).numpy()
    sel = pairs.kind == "useful"
    d = np.broadcast_to(pairs.differ[sel][:, None], (int(sel.sum()), 2, 64))
    want = (np.sign(pred[sel]) == pairs.boards[sel])[d].mean()
    got = next(r for r in rows if r["layer"] == 1 and r["kind"] == "useful")
    assert got["probe_acc"] == pytest.approx(want, abs=1e-6)
    assert got["n_stones"] == int(d.sum()) and got["n_pairs"] == int(sel.sum())
    for r in rows:
        assert 0 <= r["which_acc"] <= 1 and r["distance"] >= 0
    # the "which board" decoder: right on every held-out pair of a linear code of the board difference
    g = torch.Generator().manual_seed(0)
    c = torch.randn(40, 4, generator=g, dtype=torch.float64)  # 4 hidden causes: y and z are linear in them
    y, z = c @ torch.randn(4, 64, generator=g, dtype=torch.float64), c @ torch.randn(4, 16, generator=g,
                                                                                    dtype=torch.float64)
    assert _which_board(z, y, 1e-9) == 1.0
    assert _which_board(torch.cat([z[:20], -z[20:]]), y, 1e-9) == 0.0  # test pairs with the boards swapped
    assert math.isnan(_which_board(z[:3], y[:3], 1.0))  # below 4 pairs
    md = fragility_section({"vanilla": rows}, pairs.t)
    assert md.count("| vanilla |") == len(rows)
    with pytest.raises(ValueError, match="position"):
        measure(model, probes, find_pairs_at_other_t())


def find_pairs_at_other_t():
    from ntpflow.experiments.othello_fragility import find_pairs
    return find_pairs(10, 20, 2, seed=3)


@pytest.mark.parametrize("args, scale, work, dest", [
    ([], "paper-gpu", "results/othello-paper-gpu", "docs/results/othello-paper"),
    (["--six", "--no-replays"], "medium-6x6", "results/othello-medium-6x6-gpu", "docs/results/othello-medium-6x6-gpu"),
    (["--smoke", "w"], "paper-gpu-smoke", "w", None)])
def test_othello_gpu_script_runs_the_scale_its_options_name_and_copies_its_report(tmp_path, args, scale, work, dest):
    """``scripts/othello_gpu.sh``'s dispatch, on a copy of the script whose Python is a stand-in that records its
    arguments and writes the report's files: the scale, the work folder, --no-replays passed on, and the copy into
    docs/results/ (none for the smoke scale)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "othello_gpu.sh", tmp_path / "scripts")
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "$@" > args.txt\n'
                    'while [[ $# -gt 0 ]]; do [[ $1 == --out ]] && out=$2; shift; done\n'
                    'mkdir -p "$out/figures"\nfor f in report.md summary.json stamp.json data.json timings.json; do\n'
                    '  echo "$f" > "$out/$f"; done\ntouch "$out/figures/a.png" "$out/figures/a.svg"\n')
    fake.chmod(0o755)
    res = subprocess.run(["bash", "scripts/othello_gpu.sh", *args], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHON": str(fake)}, timeout=60)
    assert res.returncode == 0, res.stderr
    called = (tmp_path / "args.txt").read_text().split()
    assert called[called.index("--scale") + 1] == scale and called[called.index("--out") + 1] == work
    assert ("--no-replays" in called) == ("--no-replays" in args)
    copied = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "docs").rglob("*") if p.is_file()) \
        if (tmp_path / "docs").exists() else []
    assert copied == ([] if dest is None else sorted(f"{dest}/{f}" for f in (
        "report.md", "summary.json", "stamp.json", "data.json", "timings.json", "figures/a.png", "figures/a.svg")))


@pytest.mark.one_thread
def test_othello_gpu_script_smoke(tmp_path):
    """``scripts/othello_gpu.sh --smoke``: the paper-gpu code path (6 layers, token-only training set, probes, the
    tracked replay with the exact account at layers 3-4, the report) at smoke size on the CPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from ntpflow.experiments.othello import SCALES
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(root)}
    w = tmp_path / "w"

    def script(*args):
        res = subprocess.run(["bash", str(root / "scripts" / "othello_gpu.sh"), "--smoke", *args, str(w)], cwd=root,
                             env=env, capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads((w / "data.json").read_text())

    data = script("--no-replays")  # training, probes and the report only
    assert data["influence"] == [] and not (w / "run" / "attribution").exists()
    assert (w / "report.md").exists() and data["probes"]
    data = script()  # adds the replays
    smoke, paper = SCALES["paper-gpu-smoke"], SCALES["paper-gpu"]
    assert data["scale"] == "paper-gpu-smoke" and data["config"]["n_layer"] == paper.train["n_layer"] == 6
    assert {tuple(s) for s in data["sites"]} == {(s.layer, s.pos) for s in smoke.sites}
    assert {(s.layer, s.pos) for s in paper.sites} <= {(k, p) for k in range(1, 7) for p in range(4, 57, 4)}
    assert (paper.train["batch_size"], paper.train["steps"], paper.train["d_model"]) == (1024, 5000, 256)
    spec = json.loads((w / "run" / "attribution" / "spec.json").read_text())
    assert spec["readout"] == smoke.readout == 64 and spec["midpoint"] is False
    assert {r["type"] for r in data["influence"]} >= {"useful", "useless"}
    assert (w / "report.md").exists() and (w / "run" / "probes_init").exists()


def test_run_fragility_writes_the_section(scheduled_run, tmp_path):
    from ntpflow.experiments.othello_fragility import run_fragility
    _, out = scheduled_run
    res = run_fragility({"vanilla": out, "again": out}, tmp_path / "f", n_games=20, t0=20, depth=2, seed=1)
    data = json.loads((res / "fragility.json").read_text())
    assert data["t"] == 22 and sum(data["pairs"].values()) > 0
    assert data["rows"]["vanilla"] == data["rows"]["again"]  # the same weights, pairs and seed: the same numbers
    assert len(data["rows"]["vanilla"]) == 2 * 3  # kinds x (layers 0..2)
    assert "| again | 2 |" in (res / "fragility.md").read_text()
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        run_fragility({"x": tmp_path / "f"}, tmp_path / "g")
    assert not (tmp_path / "g").exists()  # nothing written before the check
