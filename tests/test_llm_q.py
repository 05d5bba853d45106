"""Q(w) by ablation on small random models (offline): adapters, SAEs, batched vs reference loop, bad input."""

import math

import pytest
import torch

pytest.importorskip("transformers", reason="the llm tests need transformers (pip install ntpflow[llm])")
pytest.importorskip("transformer_lens", reason="the llm tests need transformer-lens (pip install ntpflow[llm])")
pytest.importorskip("sae_lens", reason="the llm tests need sae-lens (pip install ntpflow[llm])")

from ntpflow.llm import qscan
from ntpflow.llm.adapters import HFAdapter, HookNameError, TLAdapter
from ntpflow.llm.corpus import DOMAINS, Contexts, build_corpus
from ntpflow.llm.sae import SimpleSAE, TrainSAEConfig, as_sae, load_sae, sae_quality, save_sae, train_sae

VOCAB, D, L, N_CTX = 97, 32, 24, 6
HOOK = "blocks.0.hook_resid_post"  # not the last block: an ablation at p reaches later positions
pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def models():
    """An HF GPT-2 and a HookedTransformer with identical random weights, in float64."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hc = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
        hf = GPT2LMHeadModel(hc).eval()
        cfg = HookedTransformerConfig(d_model=D, d_head=8, n_heads=4, n_layers=2, n_ctx=64, d_vocab=VOCAB,
                                      act_fn="gelu_new", normalization_type="LN", d_mlp=4 * D,
                                      default_prepend_bos=False, seed=0)
        tl = HookedTransformer(cfg)
    tl.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    return HFAdapter(hf.to(torch.float64)), TLAdapter(tl.to(torch.float64).eval())


@pytest.fixture(scope="module")
def sae():
    return SimpleSAE(D, 64, k=6, seed=1).double()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (N_CTX, L), generator=torch.Generator().manual_seed(2))


def _pairs(n, seed, adapter=None, sae=None, tokens=None):
    """``n`` random (latent, context, position) pairs; with a model and SAE, most latents are active there."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.randint(0, 64, (n,), generator=g)
    ctx = torch.randint(0, N_CTX, (n,), generator=g)
    pos = torch.randint(1, L - 10 + 1, (n,), generator=g)
    if adapter is not None:
        f = as_sae(sae).encode(adapter.activations(tokens, HOOK))  # [N, L, d_sae]
        for i in range(n - 2):  # the last two stay random (mostly inactive)
            active = torch.nonzero(f[ctx[i], pos[i]] > 0).flatten()
            lat[i] = active[int(torch.randint(0, active.numel(), (1,), generator=g))]
    return lat, ctx, pos


def test_adapters_same_logits_and_activations(models, tokens):
    hf, tl = models
    lh, ah = hf.logits_and_activations(tokens, HOOK)
    lt, at = tl.logits_and_activations(tokens, HOOK)
    assert torch.allclose(lh, lt, atol=1e-9) and torch.allclose(ah, at, atol=1e-9)
    assert torch.allclose(hf.activations(tokens, HOOK), ah) and torch.allclose(tl.activations(tokens, HOOK), at)


@pytest.mark.parametrize("mode", qscan.MODES)
def test_kl_zero_for_inactive_latent_error_preserving(models, sae, tokens, mode):
    hf, _ = models
    acts = hf.activations(tokens, HOOK)
    f = as_sae(sae).encode(acts)  # [N, L, 64]
    c, p = 3, 5
    dead = torch.nonzero(f[c, p] == 0).flatten()[:4]
    live = torch.nonzero(f[c, p] > 0).flatten()[:1]
    lat = torch.cat([dead, live])
    d = qscan.ablation_kl(hf, sae, tokens, HOOK, lat, torch.full_like(lat, c), torch.full_like(lat, p), mode=mode)
    if mode == "error-preserving":  # an inactive latent contributes nothing: the scan skips it, d is exactly 0
        assert torch.all(d[:-1] == 0.0)  # exact: the dead latents are skipped, not computed
    else:  # the reconstruction drops the SAE error, so even an inactive latent changes the predictions
        assert torch.all(d[:-1].sum(1) > 0)
    assert d[-1].sum() > 0


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("mode", qscan.MODES)
def test_batched_equals_reference_loop(models, sae, tokens, which, mode):
    adapter = models[which]
    lat, ctx, pos = _pairs(13, 3, adapter, sae, tokens)
    fast = qscan.ablation_kl(adapter, sae, tokens, HOOK, lat, ctx, pos, mode=mode, contexts_per_batch=2,
                             pairs_per_batch=3)
    slow = qscan.reference_loop_kl(adapter, sae, tokens, HOOK, lat, ctx, pos, mode=mode, decode_token=str)
    assert fast.shape == (13, 10)
    assert torch.allclose(fast, slow, rtol=1e-7, atol=1e-12)
    assert (fast >= -1e-12).all()
    # positions before p are untouched, so the first scored prediction already differs only through h_p
    assert (fast[:-2, 0] > 0).all() and (fast[:-2, 1:].sum(1) > 0).all()


@pytest.mark.parametrize("mode", qscan.MODES)
def test_both_adapters_give_same_q(models, sae, tokens, mode):
    hf, tl = models
    lat, ctx, pos = _pairs(9, 4, hf, sae, tokens)
    a = qscan.ablation_kl(hf, sae, tokens, HOOK, lat, ctx, pos, mode=mode)
    b = qscan.ablation_kl(tl, sae, tokens, HOOK, lat, ctx, pos, mode=mode)
    # The two adapters run the same float64 forward in another operation order (and BLAS path), so each d_m differs
    # by rounding only: a KL sums p*(log p - log q) over V terms of log-softmaxes of O(max|logit|) logits, each
    # rounded at ~eps*max|logit|; 2**10 eps leaves a wide margin over V=97 terms and two layers (measured: ~4 eps).
    eps = torch.finfo(torch.float64).eps
    atol = 2**10 * eps * max(1.0, hf.logits(tokens).abs().max().item())
    assert (a - b).abs().max() <= atol
    # Q = mean_i S_i / (d1_i + 1e-8) with S_i = sum_{m>=2} d_im: an error of atol in each d moves ratio_i by at most
    # ((H-1) + ratio_i) * atol / (d1_i + 1e-8), which is large only where d1_i is tiny (the 1e-8 floor amplifies it).
    ratio = a[:, 1:].sum(1) / (a[:, 0] + qscan.EPS)
    q_tol = (((a.shape[1] - 1) + ratio) * atol / (a[:, 0] + qscan.EPS)).mean().item()
    qa, ta = qscan.q_from_kl(a)
    qb, tb = qscan.q_from_kl(b)
    assert abs(qa - qb) <= q_tol and abs(ta - tb) <= a.shape[1] * atol
    if mode == "error-preserving":  # the last two pairs are inactive there: exactly zero in both, by construction
        inactive = as_sae(sae).encode(hf.activations(tokens, HOOK))[ctx, pos, lat] == 0
        assert inactive.any() and torch.all(a[inactive] == 0) and torch.all(b[inactive] == 0)  # exact: inactive latents are skipped: 0 by construction


def test_q_from_kl_matches_definition():
    d = torch.tensor([[0.5, 0.1, 0.2] + [0.0] * 7, [0.0, 0.3] + [0.0] * 8], dtype=torch.float64)
    q, tot = qscan.q_from_kl(d)
    assert q == pytest.approx(((0.3 / (0.5 + 1e-8)) + 0.3 / 1e-8) / 2)
    assert tot == pytest.approx((0.8 + 0.3) / 2)


def test_sae_lens_sae_and_training(models, tokens):
    from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig

    hf, _ = models
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        sl = StandardSAE(StandardSAEConfig(d_in=D, d_sae=48)).double()
    with torch.no_grad():
        sl.b_enc.fill_(-0.05)
    acts = hf.activations(tokens, HOOK)
    f = as_sae(sl).encode(acts)
    c, p = 1, 4
    dead = torch.nonzero(f[c, p] == 0).flatten()[:3]
    d = qscan.ablation_kl(hf, sl, tokens, HOOK, dead, torch.full_like(dead, c), torch.full_like(dead, p),
                          mode="error-preserving")
    assert torch.all(d == 0.0)  # exact: inactive latents are skipped by the scan, 0 by construction
    sae, info = train_sae(acts.reshape(-1, D).float(), TrainSAEConfig(d_sae=64, k=4, steps=30, batch_size=64, seed=0))
    qual = sae_quality(sae, acts.reshape(-1, D).float())
    assert -1.0 < qual.explained_variance <= 1.0 and 0 < qual.l0 <= 4 + 1e-9 and 0 <= qual.dead_fraction <= 1
    assert info["scale"] > 0


def test_sae_storage_round_trip(models, tokens, tmp_path):
    """Both SAE kinds save as sae_weights.safetensors + cfg.json (no pickle) and load back to the same codes and
    reconstruction."""
    hf, _ = models
    acts = hf.activations(tokens, HOOK).reshape(-1, D).float()
    simple = SimpleSAE(D, 24, k=3, seed=2)
    trained, _ = train_sae(acts, TrainSAEConfig(d_sae=32, k=4, steps=5, batch_size=32, seed=0))
    for name, sae in (("simple", simple), ("sae_lens", trained)):
        save_sae(sae, tmp_path / name)
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["cfg.json", "sae_weights.safetensors"], name
        back, h = load_sae(tmp_path / name), as_sae(sae)
        # sae-lens's inference format folds the decoder norms into the weights: the same codes and reconstruction,
        # up to float32 rounding (~1e-8 here); a SimpleSAE comes back bit for bit
        tol = {"rtol": 0, "atol": 0} if name == "simple" else {"rtol": 1e-5, "atol": 1e-6}
        assert torch.allclose(as_sae(back).encode(acts), h.encode(acts), **tol), name
        assert torch.allclose(as_sae(back).decode(as_sae(back).encode(acts)), h.decode(h.encode(acts)), **tol), name
    assert isinstance(load_sae(tmp_path / "simple"), SimpleSAE)
    save_sae(trained, tmp_path / "simple")  # an existing folder is replaced
    assert not isinstance(load_sae(tmp_path / "simple"), SimpleSAE)
    with pytest.raises(FileNotFoundError, match="no SAE"):
        load_sae(tmp_path)


def test_contexts_round_trip(tmp_path):
    ctx = Contexts(torch.arange(12).reshape(3, 4), ["math", "stories", "code"], [0, 0, 5])
    ctx.save(tmp_path / "contexts.safetensors")
    assert (tmp_path / "contexts.json").exists()
    back = Contexts.load(tmp_path / "contexts.safetensors")
    assert torch.equal(back.tokens, ctx.tokens) and back.domains == ctx.domains and back.doc_index == ctx.doc_index


def test_q_scan_end_to_end(models, sae):
    hf, _ = models
    g = torch.Generator().manual_seed(6)
    toks = torch.randint(0, VOCAB, (9, 20), generator=g)
    ctx = Contexts(toks, [DOMAINS[i % 3] for i in range(9)], list(range(9)))
    cfg = qscan.QScanConfig(n_candidates=6, n_examples=3, dedup_distance=10)
    res = qscan.q_scan(hf, sae, ctx, HOOK, latents=range(16), cfg=cfg)
    assert set(res) == set(qscan.MODES)
    r = res["reconstruction"]
    assert len(r.q) == 16 and all(n <= 3 for n in r.n_examples)
    for q, n, share in zip(r.q, r.n_examples, r.domain_share):
        assert (n == 0) == math.isnan(q)
        if n:
            assert sum(share) == pytest.approx(1.0)
    assert all((t > 0.05) == i for t, i, n in zip(r.total_kl, r.included, r.n_examples) if n)
    # the recorded examples have their future within the context
    top = qscan.top_activations(hf, sae, toks, HOOK, range(16), k=6)
    ex = qscan.select_examples(top, toks, 3)
    assert all(e.position + 10 <= 20 and e.position >= 1 and e.activation > 0 for v in ex.values() for e in v)
    stats = qscan.q_statistics(r)
    assert "sigma_lnq_formal" in stats and "high_tail" in stats


def test_edit_distance():
    def lev(a, b):
        dp = list(range(len(b) + 1))
        for i, x in enumerate(a, 1):
            prev, dp[0] = dp[0], i
            for j, y in enumerate(b, 1):
                prev, dp[j] = dp[j], min(dp[j] + 1, dp[j - 1] + 1, prev + (x != y))
        return dp[-1]

    g = torch.Generator().manual_seed(7)
    for _ in range(60):
        a = torch.randint(0, 4, (int(torch.randint(0, 15, (1,), generator=g)),), generator=g).tolist()
        b = torch.randint(0, 4, (int(torch.randint(0, 15, (1,), generator=g)),), generator=g).tolist()
        for bound in (0, 2, 5):
            assert qscan.edit_distance_at_most(a, b, bound) == (lev(a, b) <= bound)


def test_corpus_domains():
    docs = build_corpus(3, seed=0, stories_path=None)
    assert [d.domain for d in docs] == ["stories"] * 3 + ["code"] * 3 + ["math"] * 3
    assert docs == build_corpus(3, seed=0, stories_path=None)
    assert any("def " in d.text or "return" in d.text or "=" in d.text for d in docs[3:6])


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("which", [0, 1])
def test_bad_hook_name(models, sae, tokens, which):
    adapter = models[which]
    lat, ctx, pos = _pairs(2, 8)
    with pytest.raises(HookNameError, match="not in the model"):
        qscan.ablation_kl(adapter, sae, tokens, "blocks.7.hook_resid_post", lat, ctx, pos)
    with pytest.raises(HookNameError, match="not in the model"):
        adapter.activations(tokens, "no.such.hook")


def test_wrong_sae_width(models, tokens):
    hf, tl = models
    lat, ctx, pos = _pairs(2, 9)
    bad = SimpleSAE(D + 1, 64, k=4, seed=0).double()
    for adapter in (hf, tl):
        with pytest.raises(ValueError, match="width mismatch"):
            qscan.ablation_kl(adapter, bad, tokens, HOOK, lat, ctx, pos)
        with pytest.raises(ValueError, match="width mismatch"):
            qscan.top_activations(adapter, bad, tokens, HOOK)


def test_context_too_short(models, sae, tokens):
    hf, _ = models
    lat = torch.tensor([0])
    with pytest.raises(ValueError, match="context too short"):
        qscan.ablation_kl(hf, sae, tokens, HOOK, lat, torch.tensor([0]), torch.tensor([L - 9]))
    with pytest.raises(ValueError, match="context too short"):
        qscan.reference_loop_kl(hf, sae, tokens, HOOK, lat, torch.tensor([0]), torch.tensor([L - 9]))
    qscan.ablation_kl(hf, sae, tokens, HOOK, lat, torch.tensor([0]), torch.tensor([L - 10]))  # just long enough
    with pytest.raises(ValueError, match="mode"):
        qscan.ablation_kl(hf, sae, tokens, HOOK, lat, torch.tensor([0]), torch.tensor([1]), mode="zero")


def test_modes_together_equal_modes_apart(models, sae, tokens):
    hf, tl = models
    lat, ctx, pos = _pairs(7, 10, hf, sae, tokens)
    for adapter in (hf, tl):
        both = qscan.ablation_kl(adapter, sae, tokens, HOOK, lat, ctx, pos, mode=qscan.MODES)
        for m in qscan.MODES:
            assert torch.allclose(both[m], qscan.ablation_kl(adapter, sae, tokens, HOOK, lat, ctx, pos, mode=m))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_layer_skip_exact_or_refused(sae, tokens, arch):
    """The ablated rows may start above the site (Llama: decoder input = embeddings), checked against the full
    forward on first use; GPT-2 adds position embeddings to its input, so there the shortcut must be refused. Either
    way the batched KL equals the reference loop."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64))
        else:
            model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=3, n_head=4))
    adapter = HFAdapter(model.double().eval())
    hook = "blocks.1.hook_resid_post"
    lat, ctx, pos = _pairs(11, 6)
    fast = qscan.ablation_kl(adapter, sae, tokens, hook, lat, ctx, pos, contexts_per_batch=3, pairs_per_batch=4)
    assert adapter._skip_exact[hook] is (arch == "llama")
    slow = qscan.reference_loop_kl(adapter, sae, tokens, hook, lat, ctx, pos)
    assert torch.allclose(fast, slow, rtol=1e-7, atol=1e-12)
    assert (fast.sum(1) > 0).all()
