"""A researcher's own question, walked as a user would, in separate processes (``python -m ntpflow``): a task of
their own (a module outside the package, or a file) → train → probe → attribute with a direction of their own →
the influence summary; a TransformerLens model and an SAELens-layout SAE on disk → qscan with their own domains.
Plus the pieces: TL hook names as sites, feature names without shell quoting, bad directions."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ntpflow import Site, make_task, parse_sites
from ntpflow.cli import main
from ntpflow.model.sites import feature_name
from ntpflow.probes import ProbeSet
from ntpflow.replay.directions import parse_direction
from ntpflow.runs.run import Run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--set", "steps=6", "n_layer=1", "d_model=32", "n_head=2", "batch_size=32", "n_train=256",
        "n_eval=128", "eval_every=3", "ckpt_every=3", "log_every=3"]


def ntpflow(*args, cwd: Path, path: Path | None = None) -> str:
    """Run ``python -m ntpflow -q ARGS`` in a new process (``path`` on its PYTHONPATH); its stdout, or fail."""
    extra = [str(path)] if path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*extra, str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "ntpflow", "-q", *map(str, args)], env=env, cwd=cwd,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _summary_rows(att: Path, feature: str) -> dict:
    """summary.json's rows of ``feature``, keyed by (layer, pos, mismatch), the feature's name dropped."""
    rows = json.loads((att / "summary.json").read_text())["probes"]
    return {(e["layer"], e["pos"], e["mismatch"]): {k: v for k, v in e.items() if k != "feature"}
            for e in rows if e["feature"] == feature}


def _same_rows(a: dict, b: dict) -> None:
    """Equal rows to float32 rounding (the same vector tracked twice: one probe matrix, two columns)."""
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].keys() == b[key].keys()
        scale = max(abs(v) for v in a[key].values() if isinstance(v, float))
        for k, v in a[key].items():  # float32 tracking: ~100 eps of the row's largest value
            if k == "useful":  # the task's mark of its feature; a direction of one's own has none
                continue
            if isinstance(v, dict):  # shares, signs_agree
                assert v.keys() == b[key][k].keys() and all(
                    x == (pytest.approx(b[key][k][c], rel=1e-4, abs=1e-6) if isinstance(x, float) else b[key][k][c])
                    for c, x in v.items()), (key, k)
                continue
            assert v == (pytest.approx(b[key][k], rel=1e-5, abs=1e-5 * scale) if isinstance(v, float)
                         else b[key][k]), (key, k)


def _own_direction(run_dir: Path, tmp: Path, site: Site, feature: str) -> Path:
    """The run's final probe of ``feature`` at ``site`` saved as the user's own ``.npy`` direction."""
    w = ProbeSet.load(Run.open(run_dir).probes_dir("final")).direction(site.layer, site.pos, feature)
    path = tmp / f"{feature}.npy"
    np.save(path, w.numpy())
    return path


PARITY = '''
import numpy as np
from ntpflow import Batch, Task


class Parity(Task):
    name = "parity"

    def __init__(self, n_bits: int = 5):
        self.n_bits, self.vocab, self.seq_len = n_bits, ("<pad>", "<bos>", "0", "1"), n_bits + 2
        self.feature_names, self.first_output_pos = ("prefix_parity",), n_bits
        self.useful = np.zeros((self.seq_len, 1), dtype=bool)
        self.useful[n_bits, 0] = True

    def sample(self, n, rng):
        bits = rng.integers(0, 2, size=(n, self.n_bits))
        prefix = np.cumsum(bits, axis=1) % 2
        tokens = np.concatenate([np.ones((n, 1), dtype=np.int64), bits + 2, prefix[:, -1:] + 2], axis=1)
        mask = np.zeros((n, self.seq_len), dtype=bool)
        mask[:, self.n_bits] = True
        legal = np.zeros((n, self.seq_len, 4), dtype=bool)
        legal[np.arange(n), self.n_bits, tokens[:, -1]] = True
        features = np.zeros((n, self.seq_len, 1), dtype=np.float32)
        features[:, 1:self.n_bits + 1, 0] = prefix
        return Batch(tokens=tokens, loss_mask=mask, legal=legal, features=features)
'''


def test_own_task_module_to_influence_of_own_direction(tmp_path, monkeypatch):
    """A module outside the package → train → probe → attribute the probe's direction as the user's own .npy
    beside the task's feature: the same vector gives the same summary rows."""
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "mytask.py").write_text(PARITY)
    monkeypatch.syspath_prepend(str(tmp_path / "lab"))  # this process reads the probes too
    monkeypatch.delitem(sys.modules, "mytask", raising=False)
    run_dir = tmp_path / "run"
    ntpflow("train", "--task", "mytask:Parity", "--out", run_dir, *TINY, cwd=tmp_path, path=tmp_path / "lab")
    table = ntpflow("probe", run_dir, cwd=tmp_path, path=tmp_path / "lab")
    assert "prefix_parity" in table
    npy = _own_direction(run_dir, tmp_path, Site(1, 3), "prefix_parity")
    out = ntpflow("attribute", run_dir, "--sites", "blocks.0.hook_resid_post:3", "--features", "prefix_parity",
                  "--direction", f"mine=1:3:{npy}", "--out", tmp_path / "att", "--device", "cpu",
                  cwd=tmp_path, path=tmp_path / "lab")
    att = Path(out.strip())
    _same_rows(_summary_rows(att, "prefix_parity"), _summary_rows(att, "mine"))
    spec = json.loads((att / "spec.json").read_text())
    assert [(d["name"], d["site"]) for d in spec["directions"]] == [("mine", [1, 3])]
    assert len(spec["directions"][0]["sha256"]) == 64


def test_own_task_file_to_influence_of_own_direction(tmp_path):
    """The same path with ``--task file:PATH``: the direction alone (no --sites) reads as the probe beside it."""
    task = make_task("majority")
    b = task.sample(384, np.random.default_rng(0))
    data = tmp_path / "mine.npz"
    np.savez(data, tokens=b.tokens, loss_mask=b.loss_mask, features=b.features, useful=task.useful, legal=b.legal,
             feature_names=np.array(task.feature_names))
    run_dir = tmp_path / "run"
    ntpflow("train", "--task", f"file:{data}", "--out", run_dir, *TINY, cwd=tmp_path)
    ntpflow("probe", run_dir, "--feature", "is_majority_0", cwd=tmp_path)
    npy = _own_direction(run_dir, tmp_path, Site(1, 4), "is_majority_0")
    with_probe = Path(ntpflow("attribute", run_dir, "--sites", "1:4", "--features", "is_majority_0", "--out",
                              tmp_path / "a", "--device", "cpu", cwd=tmp_path).strip())
    alone = Path(ntpflow("attribute", run_dir, "--direction", f"d=1:4:{npy}", "--out", tmp_path / "b", "--device",
                         "cpu", cwd=tmp_path).strip())
    _same_rows(_summary_rows(with_probe, "is_majority_0"), _summary_rows(alone, "d"))
    assert {e["feature"] for e in json.loads((alone / "summary.json").read_text())["probes"]} == {"d"}


# ------------------------------------------------------------------------------------------------------ the pieces


def test_tl_hook_names_are_sites():
    assert parse_sites("blocks.0.hook_resid_post:4") == [Site(1, 4)]
    assert parse_sites("blocks.2.hook_resid_pre:1-2,0:3") == [Site(0, 3), Site(2, 1), Site(2, 2)]
    assert Site.parse("blocks.1.hook_resid_post:3") == Site(2, 3) and Site.parse("1:5") == Site(1, 5)
    for bad in ("ln_final.hook_normalized:3", "blocks.0.attn.hook_z:1", "x:1"):
        with pytest.raises(ValueError, match="cannot parse site"):
            parse_sites(bad)
    assert parse_direction("w=blocks.0.hook_resid_pre:2:a/b.safetensors:key") == ("w", Site(0, 2), "a/b.safetensors",
                                                                                 "key")
    assert parse_direction("w=1:2:c:/x.npy") == ("w", Site(1, 2), "c:/x.npy", None)


def test_feature_names_need_no_quoting_and_old_names_are_read():
    assert make_task("majority").feature_names == ("is_majority_0", "is_majority_1", "is_majority_2")
    assert make_task("cond_majority").feature_names[0] == "prev_is_0"
    assert [feature_name(n) for n in ("is_majority_<2>", "prev_is_<0>", "is_majority_1", "sq_A1", "x_<1>")] == [
        "is_majority_2", "prev_is_0", "is_majority_1", "sq_A1", "x_<1>"]
    ps = ProbeSet(weights=torch.zeros(2, 3, 4, 2), bias=torch.zeros(2, 3, 2), alpha=1.0, train_frac=0.7,
                  feature_names=("is_majority_<0>", "is_majority_<1>"), positions=(1, 2), r=torch.zeros(2, 3, 2))
    assert ps.feature_names == ("is_majority_0", "is_majority_1")  # a probe folder written before 0.2
    assert ps.feature_index("is_majority_<1>") == ps.feature_index("is_majority_1") == 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    from ntpflow import TrainConfig, train

    out = tmp_path_factory.mktemp("own") / "run"
    cfg = TrainConfig(task="majority", device="cpu", n_layer=1, d_model=32, n_head=2, steps=4, batch_size=16,
                      n_train=128, n_eval=64, eval_every=2, ckpt_every=2, log_every=2)
    train(cfg, out, progress=False)
    return out


@pytest.mark.parametrize("make,fragment", [
    (lambda d: ["--direction", f"w=1:3:{d / 'nope.npy'}"], "does not exist"),
    (lambda d: ["--direction", f"w=1:3:{d / 'w16.npy'}"], "has width 16; the model's d_model is 32"),
    (lambda d: ["--direction", f"w=1:3:{d / 'nan.npy'}"], "non-finite"),
    (lambda d: ["--direction", f"w=5:3:{d / 'w32.npy'}"], "out of range: layer must be in 0..1"),
    (lambda d: ["--direction", f"w=1:3:{d / 'w.safetensors'}:nokey"], "has no key 'nokey'"),
    (lambda d: ["--direction", f"is_majority_0=1:3:{d / 'w32.npy'}"], "is a feature of the task"),
    (lambda d: ["--sae", str(d / "sae"), "--latents", "1,9", "--sae-site", "1:3"], "out of range"),
    (lambda d: ["--sae", str(d / "sae"), "--latents", "1", "--sae-site", "0:3"], "not the site's layer 0"),
    (lambda d: ["--sae", str(d / "sae16"), "--latents", "1", "--sae-site", "1:3"], "has width 16"),
    (lambda d: [], "give --sites"),
])
def test_a_bad_direction_is_a_one_line_error_and_writes_nothing(tiny_run, tmp_path, capsys, make, fragment):
    from safetensors.torch import save_file

    np.save(tmp_path / "w16.npy", np.ones(16, np.float32))
    np.save(tmp_path / "w32.npy", np.ones(32, np.float32))
    np.save(tmp_path / "nan.npy", np.full(32, np.nan, np.float32))
    save_file({"v": torch.ones(32)}, str(tmp_path / "w.safetensors"))
    for name, d_in in (("sae", 32), ("sae16", 16)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": 8,
                                                              "hook_name": "blocks.0.hook_resid_post"}))
        save_file({"W_dec": torch.randn(8, d_in)}, str(tmp_path / name / "sae_weights.safetensors"))
    out = tmp_path / "att"
    assert main(["attribute", str(tiny_run), *make(tmp_path), "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert not out.exists()


def test_sae_latents_are_decoder_rows(tiny_run, tmp_path):
    """--sae: directions sae_<i> are W_dec's rows; tracked instead of the task's features, as given vectors are."""
    from safetensors.torch import save_file

    from ntpflow import attribute

    sae = tmp_path / "sae"
    sae.mkdir()
    w_dec = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    (sae / "cfg.json").write_text(json.dumps({"d_in": 32, "d_sae": 6, "hook_name": "blocks.0.hook_resid_post"}))
    save_file({"W_dec": w_dec}, str(sae / "sae_weights.safetensors"))
    assert main(["-q", "attribute", str(tiny_run), "--sae", str(sae), "--latents", "4,1", "--sae-site",
                 "blocks.0.hook_resid_post:3", "--out", str(tmp_path / "a"), "--device", "cpu"]) == 0
    by_hand = attribute(tiny_run, [], directions={"sae_1": (Site(1, 3), w_dec[1]), "sae_4": (Site(1, 3), w_dec[4])},
                        out_dir=tmp_path / "b", device="cpu", progress=False)
    for latent in ("sae_1", "sae_4"):
        _same_rows(_summary_rows(tmp_path / "a", latent), _summary_rows(by_hand, latent))
    spec = json.loads((tmp_path / "a" / "spec.json").read_text())
    assert spec["features"] == [] and sorted(d["name"] for d in spec["directions"]) == ["sae_1", "sae_4"]
    with pytest.raises(ValueError, match="of other directions"):  # a resumed replay checks the vectors
        attribute(tiny_run, [], directions={"sae_1": (Site(1, 3), w_dec[2]), "sae_4": (Site(1, 3), w_dec[4])},
                  out_dir=tmp_path / "b", device="cpu", progress=False)
    assert re.fullmatch(r"[0-9a-f]{64}", spec["directions"][0]["sha256"])


def _texts(kind: str, n: int, seed: int) -> str:
    """``n`` documents of one kind separated by blank lines."""
    rng = np.random.default_rng(seed)
    words = {"news": ["the", "mayor", "said", "on", "monday", "that", "the", "city", "will", "open", "a", "park"],
             "legal": ["whereas", "the", "party", "shall", "pursuant", "to", "section", "hereby", "agree", "herein"]}
    return "\n\n".join(" ".join(rng.choice(words[kind], 30)) for _ in range(n))


def test_tl_model_and_saelens_sae_on_disk_to_qscan_with_own_domains(tmp_path):
    """A tiny HookedTransformer and an SAE in SAELens's layout saved to disk → ``ntpflow qscan`` over the user's
    domains (news, legal; legal formal), offline, in a new process."""
    from safetensors.torch import save_file
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from ntpflow.llm.adapters import save_hooked_transformer

    model = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=32, n_ctx=64, d_head=16, n_heads=2,
                                                      d_vocab=259, act_fn="gelu", d_mlp=64, seed=0))
    save_hooked_transformer(model, tmp_path / "tl")
    g = torch.Generator().manual_seed(0)
    sae = tmp_path / "sae"  # SAELens's own layout (as StandardSAE.save_model writes it)
    sae.mkdir()
    save_file({"W_enc": torch.randn(32, 16, generator=g), "b_enc": torch.zeros(16),
               "W_dec": torch.randn(16, 32, generator=g), "b_dec": torch.zeros(32)},
              str(sae / "sae_weights.safetensors"))
    (sae / "cfg.json").write_text(json.dumps({
        "d_in": 32, "d_sae": 16, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
        "normalize_activations": "none", "reshape_activations": "none", "architecture": "standard",
        "metadata": {"hook_name": "blocks.0.hook_resid_post"}}))
    (tmp_path / "news.txt").write_text(_texts("news", 6, 0))
    (tmp_path / "legal.txt").write_text(_texts("legal", 6, 1))
    out = tmp_path / "q"
    ntpflow("qscan", "--model", tmp_path / "tl", "--sae", sae, "--domains", "news:news.txt,legal:legal.txt",
            "--formal", "legal", "--docs", "6", "--ctx-len", "24", "--latents", "16", "--candidates", "4",
            "--examples", "2", "--mode", "error-preserving", "--kl-cutoff", "0", "--out", out, "--device", "cpu",
            cwd=tmp_path)
    meta = json.loads((out / "contexts.json").read_text())
    assert meta["domains"] == ["news", "legal"] and meta["formal"] == ["legal"]
    q = json.loads((out / "q_error-preserving.json").read_text())
    assert q["domains"] == ["news", "legal"] and len(q["latents"]) == 16 and any(q["n_examples"])
    for share, formal, dom, n in zip(q["domain_share"], q["is_formal"], q["domain"], q["n_examples"]):
        if n:  # the labels follow the shares: legal (formal) holds more than half, the largest share names it
            assert formal == (share[1] > 0.5) and dom == ("news", "legal")[int(np.argmax(share))]
            assert sum(share) == pytest.approx(1.0)
    stats = json.loads((out / "stats.json").read_text())["error-preserving"]
    assert set(stats["all"]) == {"news", "legal"} and stats["n_scored"] == 16


def test_qscan_bad_model_sae_or_domains_is_a_one_line_error(tmp_path, capsys):
    from ntpflow.llm.qscan_cli import main as qscan

    (tmp_path / "a.txt").write_text("some text " * 20)
    cases = [(["--model", str(tmp_path / "nope"), "--train-sae"], "does not exist"),
             (["--model", "tiny", "--train-sae", "--domains", "a:a.txt", "--formal", "b"], "not among --domains"),
             (["--model", "tiny", "--train-sae", "--domains", "a:missing.txt"], "missing.txt does not exist"),
             (["--model", "tiny", "--sae-release", "gpt2-small-res-jb", "--sae-id", "blocks.0.hook_resid_pre"],
              "cannot load SAE")]
    for args, fragment in cases:
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            assert qscan([*args, "--out", str(tmp_path / "q"), "--device", "cpu"]) == 2
        finally:
            os.chdir(cwd)
        err = capsys.readouterr().err
        assert fragment in err and err.strip().splitlines()[-1].startswith("ntpflow qscan: error:"), err
        assert not (tmp_path / "q").exists()


def test_own_loop_example_gives_the_exact_account(tmp_path):
    """examples/own_loop.py (AdamW with weight decay, warmup-cosine, clipping, through ntpflow.Account) runs as
    written (tests/test_account.py checks such a loop against torch's own calls in float64); Σ change = R_H(θ_0) − R_H(θ_T) by plain forwards; each chunk's parts (with ``decay``) add up to its full influence,
    decay is not 0, and the residual is small against R_H(θ_0)."""
    import runpy

    from ntpflow import GPT

    example = ROOT / "examples" / "own_loop.py"
    printed = dict(zip(*[iter(ntpflow_script(example, cwd=tmp_path).split())] * 2))
    ns = runpy.run_path(str(example))  # its definitions, without its __main__ block
    final, account = ns["train"]()
    result = account.finish({"mine": (Site(1, 5), ns["w"])})
    tokens = ns["tokens"]
    held = tokens[512:]

    def proj(model):
        with torch.no_grad():
            return model(held, return_resid=True)[1][1][:, 5].double() @ ns["w"].double()

    r0 = (proj(GPT(ns["cfg"], seed=0)) - proj(final)).pow(2).mean().item()
    paper = next(e for e in result.summary if e["mismatch"] == "paper")
    eps32 = torch.finfo(torch.float32).eps
    assert paper["change"] == pytest.approx(r0, rel=10 * eps32)  # R_H(θ_T) = 0: θ_T is θ*
    assert abs(paper["residual"]) < 1e-3 * r0 and paper["adamw_decay"] != 0 and paper["adamw_pre_cached"] != 0
    for row in [r for r in result.rows if r["optimizer"] == "adamw" and r["component"] == "full"]:
        parts = [r["value"] for r in result.rows if (r["step"], r["mismatch"], r["optimizer"]) == (
            row["step"], row["mismatch"], "adamw") and r["component"] in ("direct", "pre_cached", "shared", "decay")]
        assert sum(parts) == pytest.approx(row["value"], rel=1e-9, abs=1e-12 * r0)
    assert float(printed["change"]) == pytest.approx(paper["change"], rel=1e-3)  # the script prints the same


def ntpflow_script(path: Path, cwd: Path) -> str:
    """Run the Python script ``path`` in a new process (the project on its PYTHONPATH); its stdout, or fail."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(path)], env=env, cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout
