"""The LLM experiment (ntpflow.experiments.llm / llm_report) and its parts: steering score, look-ahead lens,
Q-vs-influence ablation, the qscan CLI, the smoke scale end to end and its resumability."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ntpflow.experiments.q_vs_influence import probe_ablation_kl
from ntpflow.llm.lens import fit_linear, overlap
from ntpflow.llm.qscan import q_from_kl
from ntpflow.llm.steering import code_score, pick_extremes, steering_vectors
from ntpflow.stats import spearman


def test_code_score_hand_written():
    assert code_score("") == 0.0  # exact: a count of zero characters
    assert code_score("   \n ") == 0.0  # exact: a count of zero characters
    assert code_score("Once upon a time there was a cat") == 0.0  # exact: a count of zero characters
    # non-whitespace: def(3) f(x):(5) return(6) x(1) = 15; counted: def 3 + "(", ")", ":" 3 + return 6 = 12
    assert code_score("def f(x): return x") == pytest.approx(12 / 15)
    assert code_score("{}[]();") == 1.0
    # keywords only as whole words: "define" is not "def", "if" is
    assert code_score("define") == 0.0  # exact: a count of zero characters
    assert code_score("if") == 1.0
    assert code_score("The cat sat.") == pytest.approx(1 / 10)


def test_steering_vectors_coefficient_applied_once():
    class S:
        W_dec = torch.tensor([[3.0, 4.0], [0.0, 2.0]])

    v = steering_vectors(S(), [0, 1], 10.0)
    assert torch.allclose(v, 10.0 * S.W_dec)  # not 100x (the reference's doubled coefficient)
    r = steering_vectors(S(), [0], 0.5, relative_to=4.0)
    assert torch.allclose(r.norm(dim=1), torch.tensor([2.0]))
    high, low = pick_extremes([5, 6, 7, 8, 9], [0.1, 5.0, float("nan"), 2.0, 0.01], [1, 1, 1, 1, 0], 1)
    assert high == [6] and low == [5]


def test_cached_generation_equals_full_reforward():
    from ntpflow.llm.adapters import tiny_gpt2
    from ntpflow.llm.steering import generate

    lm = tiny_gpt2(0)
    # float64: the cached and the full forward sum in different orders, so their logits differ by rounding; in float64
    # (~1e-15) a greedy pick could flip only on a near-exact tie of the top two logits, which a random model does not
    # have (in float32, ~1e-6, it could on some BLAS path)
    lm.adapter.model.double()
    prompt = torch.randint(3, 259, (3, 5), generator=torch.Generator().manual_seed(0))
    vec = torch.randn(3, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    cached = generate(lm.adapter, prompt, lm.default_hook, vec, 8)
    lm.adapter.supports_prefix_cache = False  # instance attribute: the uncached loop
    full = generate(lm.adapter, prompt, lm.default_hook, vec, 8)
    assert cached.shape == (3, 13) and torch.equal(cached, full)
    assert not torch.equal(full, generate(lm.adapter, prompt, lm.default_hook, None, 8))


def test_lens_recovers_known_map_and_overlap():
    g = torch.Generator().manual_seed(0)
    d = 8
    X = torch.randn(2000, d, generator=g)
    A_true = torch.randn(d, d, generator=g)
    b_true = torch.randn(d, generator=g)
    A, b = fit_linear(X, X @ A_true.T + b_true, ridge=0.0)
    assert torch.allclose(A, A_true, atol=1e-4) and torch.allclose(b, b_true, atol=1e-4)
    # A with top-2 right singular directions e0, e1: encoder columns along them overlap 1, orthogonal ones 0
    A2 = torch.diag(torch.tensor([10.0, 9.0] + [1.0] * (d - 2)))
    E = torch.eye(d)[:, [0, 1, 5]]
    E[:, 2] = torch.eye(d)[5]
    ov = overlap(A2, E, [2])[2]
    assert torch.allclose(ov, torch.tensor([1.0, 1.0, 0.0]), atol=1e-6)
    mixed = overlap(A2, (torch.eye(d)[0] + torch.eye(d)[5])[:, None], [2])[2]
    assert mixed.item() == pytest.approx(2 ** -0.5, abs=1e-6)
    s = spearman([1, 2, 3, 4, 5], [5, 4, 3, 2, 1])
    assert s["rho"] == pytest.approx(-1.0) and s["n"] == 5
    assert spearman([1, 2], [1, 2])["rho"] is None


def test_probe_ablation_zero_direction_gives_zero_kl():
    from ntpflow.model.config import GPTConfig
    from ntpflow.model.gpt import GPT

    model = GPT(GPTConfig(vocab_size=7, n_ctx=12, n_layer=2, n_head=2, d_model=16), seed=0)
    tokens = torch.randint(0, 7, (20, 12), generator=torch.Generator().manual_seed(1))
    d0 = probe_ablation_kl(model, tokens, 1, 3, torch.zeros(16), horizon=10)
    assert d0.shape == (20, 8) and float(d0.abs().max()) == 0.0  # exact: ablating along 0 leaves the logits bit-identical
    w = torch.randn(16, generator=torch.Generator().manual_seed(2))
    d1 = probe_ablation_kl(model, tokens, 1, 3, w)
    assert float(d1.max()) > 0 and float(d1[:, 0].min()) >= 0
    q, tot = q_from_kl(d1)
    assert q > 0 and tot > 0
    # after the last block only the prediction at pos itself can change: Q = 0
    d2 = probe_ablation_kl(model, tokens, 2, 3, w)
    assert float(d2[:, 0].max()) > 0 and float(d2[:, 1:].abs().max()) == 0.0  # exact: later positions never see the last block's residual at pos
    with pytest.raises(ValueError, match="no later prediction"):
        probe_ablation_kl(model, tokens, 1, 11, torch.zeros(16))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from ntpflow.experiments.llm import run_llm
    from ntpflow.experiments.llm_report import write_report

    out = tmp_path_factory.mktemp("llm") / "smoke"
    run_llm("smoke", out, device="cpu", progress=False)
    write_report(out)
    return out


def test_smoke_end_to_end(smoke):
    for name in ("meta.json", "quality.json", "contexts.safetensors", "contexts.json", "sae/sae_weights.safetensors",
                 "sae/cfg.json", "q_reconstruction.json", "q_error-preserving.json", "stats.json", "steering.json",
                 "lens.json", "q_vs_influence.json", "summary.json", "report.md", "report.html", "timing.json"):
        assert (smoke / name).exists(), name
    for fig in ("lnq_hist", "q_tails", "steering", "lens", "q_vs_influence"):
        for ext in ("png", "svg"):
            assert (smoke / "figures" / f"{fig}.{ext}").exists(), fig
    s = json.loads((smoke / "summary.json").read_text())  # strict JSON: NaN was turned into null
    assert s["scale"] == "smoke" and s["setup"]["model"] == "tiny-random-gpt2"
    assert set(s["q"]) == {"reconstruction", "error-preserving"}
    assert len(s["claims"]) == 5
    for c in s["claims"]:
        assert {"claim", "paper", "measured", "rule", "verdict", "preconditions", "numbers"} <= set(c)
        assert c["verdict"] in ("reproduced", "not reproduced", "inconclusive", "not testable at this scale")
    assert s["lens"]["metrics"][0]["k"] == 1 and len(s["lens"]["metrics"]) == 5
    assert s["q_vs_influence"]["n"] >= 4
    html = (smoke / "report.html").read_text()
    assert 'id="claims"' in html and "data:image/png;base64," in html
    assert "tiny-random-gpt2" in (smoke / "report.md").read_text()


def test_smoke_resumes_and_skips_done_stages(smoke):
    from ntpflow.experiments.llm import run_llm

    mtimes = {p.name: p.stat().st_mtime_ns for p in smoke.iterdir() if p.suffix == ".json" and p.name != "meta.json"}
    os.remove(smoke / "steering.json")
    run_llm("smoke", smoke, device="cpu", progress=False)
    assert (smoke / "steering.json").exists()
    for name in ("q_reconstruction.json", "lens.json", "q_vs_influence.json", "quality.json"):
        assert (smoke / name).stat().st_mtime_ns == mtimes[name], name
    with pytest.raises(ValueError, match="scale 'smoke'"):
        run_llm("small", smoke, progress=False)


def test_reuse_of_the_sae_only_is_recorded_and_reported(smoke, tmp_path):
    """A reuse folder with corpus + SAE but no scan: the scan runs here, meta.json and the report say that only
    the SAE was reused, and the reused SAE files are the originals."""
    from ntpflow.experiments.llm import run_llm
    from ntpflow.experiments.llm_report import write_report

    src = tmp_path / "src"
    src.mkdir()
    for name in ("contexts.safetensors", "contexts.json", "quality.json"):
        shutil.copyfile(smoke / name, src / name)
    shutil.copytree(smoke / "sae", src / "sae")
    out = tmp_path / "out"
    run_llm("smoke", out, device="cpu", progress=False, reuse=src, stages=("sae", "scan"))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["reused_stages"] == ["sae"] and meta["reuse"] == str(src)
    assert (out / "quality.json").read_bytes() == (smoke / "quality.json").read_bytes()
    assert (out / "stats.json").exists()  # the scan was computed here
    write_report(out)
    text = (out / "report.md").read_text()
    assert f"Corpus and SAE (the scan was computed here) reused from {src}." in text
    assert "scan (in the reused run)" not in text


def test_paper_scale_fails_offline_in_one_line(tmp_path, monkeypatch):
    from ntpflow.experiments.llm import run_llm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError) as e:
        run_llm("paper", tmp_path / "p", progress=False)
    assert "internet" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "p").exists()
    with pytest.raises(ValueError, match="unknown scale"):
        run_llm("huge", tmp_path / "q", progress=False)


def test_qscan_cli(tmp_path, capsys):
    from ntpflow.llm.qscan_cli import main

    assert main(["--model", "tiny", "--train-sae", "--out", str(tmp_path / "a"), "--mode", "bogus"]) == 2
    assert "error: --mode" in capsys.readouterr().err
    assert main(["--model", "tiny", "--sae", str(tmp_path / "none"), "--out", str(tmp_path / "b")]) == 2
    assert "does not exist" in capsys.readouterr().err
    rc = main(["--model", "tiny", "--train-sae", "--latents", "4", "--docs", "3", "--ctx-len", "40", "--d-sae",
               "16", "--k", "2", "--steps", "20", "--candidates", "4", "--examples", "2", "--kl-cutoff", "0",
               "--mode", "error-preserving", "--out", str(tmp_path / "c")])
    assert rc == 0
    assert (tmp_path / "c" / "q_error-preserving.json").exists() and (tmp_path / "c" / "sae").is_dir()
    assert not (tmp_path / "c" / "q_reconstruction.json").exists()
    # the saved SAE loads back for a second scan
    assert main(["--model", "tiny", "--sae", str(tmp_path / "c" / "sae"), "--latents", "3", "--docs", "3",
                 "--ctx-len", "40", "--candidates", "4", "--examples", "2", "--out", str(tmp_path / "d")]) == 0


def test_qscan_train_then_scan(tmp_path, capsys):
    """`ntpflow qscan train` then `scan`: the two halves of the full run, over the same folder."""
    from ntpflow.llm.qscan_cli import main

    out = str(tmp_path / "e")
    assert main(["scan", "--model", "tiny", "--out", out]) == 2
    assert "qscan train --out" in capsys.readouterr().err
    assert main(["train", "--model", "tiny", "--docs", "3", "--ctx-len", "40", "--d-sae", "16", "--k", "2",
                 "--steps", "20", "--out", out]) == 0
    q = json.loads((tmp_path / "e" / "quality.json").read_text())
    assert q["model"] == "tiny-random-gpt2" and q["eval"]["n_tokens"] > 0 and q["sae"]["config"]["batch_size"] == 256
    assert not (tmp_path / "e" / "stats.json").exists()
    assert main(["scan", "--model", "tiny", "--latents", "3", "--candidates", "4", "--examples", "2",
                 "--kl-cutoff", "0", "--out", out]) == 0
    stats = json.loads((tmp_path / "e" / "stats.json").read_text())
    assert set(stats) == {"seconds", "reconstruction", "error-preserving", "stamp"}  # stamp: who made it
    assert set(stats["stamp"]) == set(q["stamp"]) == {"ntpflow", "git_commit", "git_dirty", "date", "command"}
    assert stats["reconstruction"]["n_scored"] == 3



def test_committed_report_rerenders_byte_identical(tmp_path):
    """The committed llm-small folder (summary.json and figures, no run files) re-renders from its stored numbers, and
    a second render changes no byte of report.md, report.html, summary.json or the figures."""
    from ntpflow.experiments.llm_report import write_report

    committed = Path(__file__).resolve().parents[1] / "docs" / "results" / "llm-small"
    out = tmp_path / "llm-small"
    shutil.copytree(committed, out, ignore=shutil.ignore_patterns("report.html"))
    write_report(out)
    first = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert {Path("report.md"), Path("report.html"), Path("summary.json")} <= set(first)
    write_report(out)
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == first
