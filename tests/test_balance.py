"""The balance audit: its directional derivatives against autograd in float64, its sums against an attribution and
against the mismatch computed from the initial and final weights, resuming, and its errors."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from ntpflow.engine.influence import Probe
from ntpflow.model.config import GPTConfig
from ntpflow.model.gpt import GPT
from ntpflow.model.sites import Site
from ntpflow.replay.attribution import attribute
from ntpflow.replay.balance import audit_balance, directional_terms, probe_projections
from ntpflow.replay.spec import AttributionSpec
from ntpflow.replay.tracked import make_probes
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.data import make_datasets
from ntpflow.runs.run import Run
from ntpflow.runs.training import train

TINY = {"n_layer": 2, "d_model": 32, "n_head": 2, "steps": 16, "batch_size": 32, "n_train": 512, "n_eval": 256,
        "eval_every": 8, "ckpt_every": 8, "log_every": 4}
SITES, FEATURE = [Site(1, 3), Site(1, 5)], "is_majority_<0>"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "maj"
    train(TrainConfig(**TINY), path, progress=False)
    return path


@pytest.mark.parametrize("position_groups", [None, (0,) * 5 + (1,) * 4])
def test_directional_terms_match_autograd_in_float64(position_groups):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=7, n_ctx=9, n_layer=2, d_model=16, n_head=2, position_groups=position_groups)
    model, final = GPT(cfg, seed=1).double(), GPT(cfg, seed=2).double()
    tokens = torch.randint(0, 7, (12, 9))
    probes = [Probe(Site(1, 4), "a", torch.randn(16, dtype=torch.float64)),
              Probe(Site(2, 6), "b", torch.randn(16, dtype=torch.float64)),
              Probe(Site(0, 2), "c", torch.randn(16, dtype=torch.float64))]
    direction = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    star = probe_projections(final, tokens, probes)
    got = directional_terms(model, direction, tokens, probes, star)
    # oracle: the mismatch from the full forward, its gradient by autograd, dotted with the direction
    _, resid = model(tokens, return_resid=True, myopic="none")
    _, resid_star = final(tokens, return_resid=True, myopic="none")
    for n, p in enumerate(probes):
        d = (resid[p.site.layer][:, p.site.pos] - resid_star[p.site.layer][:, p.site.pos].detach()) @ p.w
        for mismatch, r in (("paper", d.pow(2).mean()), ("centred", d.var(unbiased=False))):
            grads = torch.autograd.grad(r, list(model.parameters()), retain_graph=True, allow_unused=True)
            dr = sum((g.flatten() @ v).item() for g, v in zip(grads, direction.split(
                [q.numel() for q in model.parameters()])) if g is not None)
            assert got[mismatch][0, n].item() == pytest.approx(r.item(), rel=1e-10, abs=1e-12)
            assert got[mismatch][1, n].item() == pytest.approx(dr, rel=1e-9, abs=1e-12)


def test_audit_agrees_with_attribution_and_the_weights(finished_run, tmp_path):
    out = audit_balance(finished_run, SITES, [FEATURE], out_dir=tmp_path / "b", n_held_out=TINY["n_eval"],
                        progress=False)
    audit = json.loads((out / "summary.json").read_text())
    att = attribute(finished_run, AttributionSpec(SITES, [FEATURE], sgd_rows=False, reading="paper"),
                    out_dir=tmp_path / "a", progress=False)
    tracked = {(p["layer"], p["pos"], p["mismatch"]): p for p in json.loads((att / "summary.json").read_text())["probes"]}
    mid = attribute(finished_run, AttributionSpec(SITES, [FEATURE], sgd_rows=False, reading="midpoint"),
                    out_dir=tmp_path / "m", progress=False)
    at_mid = {(p["layer"], p["pos"], p["mismatch"]): p for p in json.loads((mid / "summary.json").read_text())["probes"]}
    # the held-out mismatch of the initial and final weights, computed here from the run's files
    run = Run.open(finished_run)
    _, eval_set = make_datasets(run.cfg, run.task)
    held = torch.as_tensor(eval_set.tokens)
    _, r0 = run.load_model("init")(held, return_resid=True, myopic="none")
    _, rT = run.load_model("final")(held, return_resid=True, myopic="none")
    probes = {p.site: p for p in make_probes(run, SITES, [FEATURE])}
    assert len(audit["probes"]) == 2 * len(SITES)
    for e in audit["probes"]:
        t = tracked[e["layer"], e["pos"], e["mismatch"]]
        scale = abs(t["adam_full"]) + abs(e["full_held_out"])
        # Σ −⟨∇R_B, Δθ⟩ along the real step is the tracker's full Adam influence (float32 rounding per step)
        assert e["full_batch"] == pytest.approx(t["adam_full"], abs=1e-4 * scale)
        # read at the midpoints, it is the midpoint tracker's full influence
        m = at_mid[e["layer"], e["pos"], e["mismatch"]]["adam_full"]
        assert e["midpoint_batch"] == pytest.approx(m, abs=1e-4 * (abs(m) + abs(e["midpoint_held_out"])))
        w, k, i = probes[Site(e["layer"], e["pos"])].w, e["layer"], e["pos"]
        with torch.no_grad():
            d0, dT = ((r[k][:, i] - rT[k][:, i]) @ w for r in (r0, rT))
        removed = (d0.pow(2).mean() if e["mismatch"] == "paper" else d0.var(unbiased=False)).item()
        assert e["removed_held_out"] == pytest.approx(removed, rel=1e-4)
        assert e["removed_held_out"] == pytest.approx(t["R0_minus_RT_eval"], rel=1e-4)
        assert e["same_batch"] + e["beyond_first_order"] == pytest.approx(e["full_batch"] - e["removed_held_out"])
        assert len(e["curve"]["full_batch"]) == len(audit["curve_steps"]) == 2  # every ckpt_every = 8 steps
        assert e["curve"]["removed_held_out"][-1] == e["removed_held_out"]


def test_one_step_audit_matches_autograd_at_both_points(tmp_path):
    # one training step: Δθ = θ_1 − θ_0 is the run's final minus initial weights, so every term has a float64 oracle
    path = tmp_path / "one"
    train(TrainConfig(**{**TINY, "steps": 1, "ckpt_every": 1, "eval_every": 1, "log_every": 1}), path, progress=False)
    out = audit_balance(path, [Site(1, 3)], [FEATURE], n_held_out=64, progress=False)
    audit = {e["mismatch"]: e for e in json.loads((out / "summary.json").read_text())["probes"]}
    run = Run.open(path)
    init, final = run.load_model("init").double(), run.load_model("final").double()
    w = make_probes(run, [Site(1, 3)], [FEATURE])[0].w.double()
    held = torch.as_tensor(make_datasets(run.cfg, run.task)[1].tokens[:64])
    star = final(held, return_resid=True, myopic="none")[1][1][:, 3].detach() @ w
    delta = [f.detach() - i.detach() for f, i in zip(final.parameters(), init.parameters())]
    for name, s in (("full_held_out", 0.0), ("midpoint_held_out", 0.5)):
        at = run.load_model("init").double()
        with torch.no_grad():
            for p, i, dlt in zip(at.parameters(), init.parameters(), delta):
                p.copy_(i + s * dlt)
        d = at(held, return_resid=True, myopic="none")[1][1][:, 3] @ w - star
        for mismatch, r in (("paper", d.pow(2).mean()), ("centred", d.var(unbiased=False))):
            grads = torch.autograd.grad(r, list(at.parameters()), retain_graph=True, allow_unused=True)
            f = -sum((g * dlt).sum().item() for g, dlt in zip(grads, delta) if g is not None)
            assert audit[mismatch][name] == pytest.approx(f, rel=1e-3, abs=1e-9), (name, mismatch)


def test_audit_resumes_after_kill(finished_run, tmp_path):
    cmd = [sys.executable, "-m", "ntpflow", "-q", "balance", str(finished_run), "--sites", "1:3",
           "--features", FEATURE, "--held-out", "64"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    assert subprocess.run([*cmd, "--out", str(ref)], check=False).returncode == 0
    env = {**os.environ, "NTPFLOW_FAULT": "attribute:after_checkpoint:kill"}  # right after the first resume point
    assert subprocess.run([*cmd, "--out", str(out)], check=False, env=env).returncode == -signal.SIGKILL
    assert list((out / "state").glob("step_*")) and not (out / "summary.json").exists()
    assert subprocess.run([*cmd, "--out", str(out)], check=False, capture_output=True).returncode == 0
    a, b = (json.loads((d / "summary.json").read_text()) for d in (ref, out))
    assert a.pop("stamp")["command"] != b.pop("stamp")["command"]  # each says which command made it
    assert a == b


@pytest.mark.parametrize("args, message", [
    (["--sites", "1:3", "--held-out", "1"], "n_held_out must be at least 2"),
    (["--sites", "5:3"], "layer"),
    (["--sites", "1:3", "--features", "nope"], "unknown feature"),
])
def test_bad_input_is_one_line_and_writes_nothing(finished_run, tmp_path, args, message):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "ntpflow", "balance", str(finished_run), "--out", str(out), *args],
                         check=False, capture_output=True, text=True)
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()
