"""Invariants of the GPT model, each against an independent computation.

Tolerances: the models are float64 with O(1) activations, so two forwards that sum in different orders (SDPA vs the
manual attention, untied vs tied weights, another BLAS path or thread count) differ by a few eps (~1e-15); atol=1e-12
(~4.5e3 eps) leaves room for every sum over d_model=16 terms through two layers. atol=0 only where both sides run the
very same arithmetic (a detach, weights of another group that the compared positions never read).
"""

import pytest
import torch

from ntpflow import GPT, GPTConfig, Site, lm_loss, per_position_loss, split_groups
from ntpflow.model.hooks import hooks, run_with_cache
from ntpflow.model.sites import checked_sites

T, V = 8, 7


def tiny(dtype=torch.float64, seed=0, **kw) -> GPT:
    cfg = GPTConfig(vocab_size=V, n_ctx=T, n_layer=kw.pop("n_layer", 2), n_head=2, d_model=16, **kw)
    return GPT(cfg, seed=seed).to(dtype)


@pytest.fixture
def tokens():
    return torch.randint(0, V, (5, T), generator=torch.Generator().manual_seed(1))


def with_params(model: GPT, other: GPT) -> GPT:
    """``model`` with the parameter values of ``other`` (same shapes)."""
    model.load_state_dict(other.state_dict())
    return model


@pytest.mark.parametrize("mode", ["kv", "resid"])
@pytest.mark.parametrize("groups", [None, "untied", split_groups(T, 3)])
def test_myopic_forward_equals_vanilla(tokens, mode, groups):
    van = tiny(position_groups=groups)
    myo = with_params(tiny(position_groups=groups, myopic=mode), van)
    # vanilla runs SDPA, myopic runs the manual attention: they agree
    torch.testing.assert_close(myo(tokens), van(tokens), rtol=0, atol=1e-12)
    torch.testing.assert_close(van(tokens, myopic=mode), van(tokens), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["kv", "resid"])
def test_myopic_blocks_gradient_from_later_losses(tokens, mode):
    model = tiny(myopic=mode, n_layer=3)
    logits, resid = model.run_with_resid(tokens)
    per_pos, _ = per_position_loss(logits, tokens)
    for j in range(1, T - 1):
        grads = torch.autograd.grad(per_pos[j], resid, retain_graph=True)
        for k, g in enumerate(grads):
            assert torch.count_nonzero(g[:, :j]) == 0, (mode, j, k)
            assert g[:, j].abs().sum() > 0  # the own-position path is alive
    # vanilla does send gradient from L_j back to earlier positions (the test can fail)
    logits, resid = with_params(tiny(n_layer=3), model).run_with_resid(tokens)
    per_pos, _ = per_position_loss(logits, tokens)
    assert torch.autograd.grad(per_pos[5], resid[1])[0][:, :5].abs().sum() > 0


def test_one_layer_kv_weight_gradients(tokens):
    """'resid' keeps W_K/W_V gradients of vanilla in a one-layer model; 'kv' removes the off-diagonal part."""
    van = tiny(n_layer=1)

    def attn_grad(model):
        loss = lm_loss(model(tokens), tokens)
        return torch.autograd.grad(loss, model.blocks[0].attn.c_attn.weight)[0]

    g_van = attn_grad(van)
    g_resid = attn_grad(with_params(tiny(n_layer=1, myopic="resid"), van))
    g_kv = attn_grad(with_params(tiny(n_layer=1, myopic="kv"), van))
    torch.testing.assert_close(g_resid, g_van, rtol=1e-10, atol=1e-14)
    d = 16
    assert not torch.allclose(g_kv[:, d:], g_van[:, d:], atol=1e-8)  # key/value rows differ
    torch.testing.assert_close(g_kv[:, :d], g_van[:, :d], rtol=1e-10, atol=1e-14)  # query rows do not


def test_untied_at_init_equals_tied(tokens):
    tied = tiny(seed=3)
    for groups in ("untied", split_groups(T, 4), [0, 1, 2, 0, 1, 2, 0, 1]):
        untied = tiny(seed=3, position_groups=groups)
        torch.testing.assert_close(untied(tokens), tied(tokens), rtol=0, atol=1e-12)
        for p in untied.parameters():  # every group starts as the same copy
            assert torch.equal(p, p[:1].expand_as(p))  # exact: untied groups start as copies


def test_untied_loss_touches_only_its_own_and_earlier_groups(tokens):
    model = tiny(position_groups="untied")
    logits = model(tokens)
    per_pos, _ = per_position_loss(logits, tokens)
    for p in range(T - 1):
        grads = torch.autograd.grad(per_pos[p], list(model.parameters()), retain_graph=True, allow_unused=True)
        for (name, param), g in zip(model.named_parameters(), grads):
            g = torch.zeros_like(param) if g is None else g
            assert torch.count_nonzero(g[p + 1:]) == 0, (p, name)
        # and its own group does get gradient
        own = sum(g[p].abs().sum() for g in grads if g is not None)
        assert own > 0


def test_split_groups_route_positions(tokens):
    """In a 2-group split, changing group 1's weights leaves logits at positions < m untouched."""
    m = 3
    model = tiny(position_groups=split_groups(T, m))
    before = model(tokens)
    with torch.no_grad():
        for p in model.parameters():
            p[1].add_(0.1)
    after = model(tokens)
    torch.testing.assert_close(after[:, :m], before[:, :m], rtol=0, atol=0)  # exact: group 0's matmuls get the same inputs and weights
    assert not torch.allclose(after[:, m:], before[:, m:])


def test_hf_round_trip(tokens):
    pytest.importorskip("transformers")
    model = tiny(dtype=torch.float32, seed=5)
    hf = model.to_hf()
    torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    back = GPT.from_hf(hf)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), back.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)  # exact: a round trip of the same tensors
    with pytest.raises(ValueError, match="one position group"):
        tiny(position_groups="untied").to_hf()


def test_hf_init_scale_matches_gpt2_convention():
    model = GPT(GPTConfig(vocab_size=50, n_ctx=64, n_layer=4, n_head=4, d_model=256), seed=0)
    assert abs(model.wte.std().item() - 0.02) < 1e-3
    assert abs(model.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    assert abs(model.blocks[0].attn.c_proj.weight.std().item() - 0.02 / 8**0.5) < 5e-4
    assert torch.all(model.blocks[0].ln1.weight == 1) and torch.all(model.blocks[0].attn.c_attn.bias == 0)  # exact: initial constants


def test_stop_grad_at_blocks_exactly_that_residual(tokens):
    model = tiny(n_layer=2)
    site = Site(1, 4)
    plain = model(tokens)
    stopped = model(tokens, stop_grad_at=[site])
    torch.testing.assert_close(stopped, plain, rtol=0, atol=0)  # exact: stop_grad_at changes the backward only

    # oracle: detach the same residual through a hook (independent mechanism)
    def detach_pos(act, hook):
        return torch.cat([act[:, :4], act[:, 4:5].detach(), act[:, 5:]], dim=1)

    params = list(model.parameters())
    g_sg = torch.autograd.grad(lm_loss(stopped, tokens), params)
    with hooks(model, [("blocks.1.hook_resid_pre", detach_pos)]):
        g_hook = torch.autograd.grad(lm_loss(model(tokens), tokens), params)
    for a, b in zip(g_sg, g_hook):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    g_plain = torch.autograd.grad(lm_loss(plain, tokens), params)
    assert any(not torch.allclose(a, b) for a, b in zip(g_sg, g_plain))
    # the final layer (before ln_final) and layer 0 are valid sites too
    for s in (Site(2, 3), Site(0, 0)):
        torch.testing.assert_close(model(tokens, stop_grad_at=[s]), plain, rtol=0, atol=0)  # exact: stop_grad_at changes the backward only


def test_resid_convention_matches_hooks(tokens):
    model = tiny()
    _, resid = model.run_with_resid(tokens)
    _, cache = run_with_cache(model, tokens)
    torch.testing.assert_close(resid[0], cache["hook_embed"] + cache["hook_pos_embed"])
    torch.testing.assert_close(resid[1], cache["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(resid[2], cache["blocks.1.hook_resid_post"])
    assert Site(2, 0).hook_name(2) == "blocks.1.hook_resid_post"
    assert Site(1, 0).hook_name(2) == "blocks.1.hook_resid_pre"


def test_hook_names_pinned(tokens):
    model = tiny(n_layer=1)
    _, cache = run_with_cache(model, tokens)
    assert list(cache) == [
        "hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre", "blocks.0.ln1.hook_normalized",
        "blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v", "blocks.0.attn.hook_pattern",
        "blocks.0.attn.hook_z", "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid",
        "blocks.0.ln2.hook_normalized", "blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post", "blocks.0.hook_mlp_out",
        "blocks.0.hook_resid_post", "ln_final.hook_normalized",
    ]
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern.shape == (5, 2, T, T)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(5, 2, T, dtype=pattern.dtype))
    assert torch.all(pattern.triu(1) == 0)  # exact: masked scores are -inf, so softmax gives exact zeros


def test_loss_matches_hand_computation():
    logits = torch.randn(3, 4, 5, dtype=torch.float64)
    tokens = torch.randint(0, 5, (3, 4))
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    logp = logits.log_softmax(-1)
    expected = []
    for p in range(3):
        rows = [-logp[b, p, tokens[b, p + 1]] for b in range(3) if mask[b, p]]
        expected.append(sum(rows) / len(rows))
    per_pos, counted = per_position_loss(logits, tokens, mask)
    torch.testing.assert_close(per_pos, torch.stack(expected))
    assert counted.all()
    torch.testing.assert_close(lm_loss(logits, tokens, mask), torch.stack(expected).mean())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"position_groups": [0, 1]}, "length"),
        ({"position_groups": [0] * 4 + [2] * 4}, "every id"),
        ({"position_groups": "tied-ish"}, "position_groups"),
        ({"myopic": "future"}, "myopic"),
        ({"d_model": 15}, "divisible"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(vocab_size=V, n_ctx=T, n_head=2, d_model=kwargs.pop("d_model", 16), **kwargs)


def test_bad_forward_inputs(tokens):
    model = tiny()
    with pytest.raises(ValueError, match="out of range"):
        model(tokens, stop_grad_at=[Site(3, 0)])
    with pytest.raises(ValueError, match="out of range"):
        model(tokens, stop_grad_at=[Site(0, T)])
    with pytest.raises(ValueError, match="n_ctx"):
        model(torch.zeros(1, T + 1, dtype=torch.long))


@pytest.mark.parametrize("kw", [{}, {"myopic": "kv"}, {"myopic": "resid"}, {"position_groups": "untied"},
                                {"position_groups": split_groups(T, 3), "myopic": "resid"}])
def test_resid_last_matches_full_forward(tokens, kw):
    """resid_last (last block for the last query only) equals resid[k] of the full forward, value and gradient."""
    model = tiny(**kw)
    params = list(model.parameters())
    for k in range(model.cfg.n_layer + 1):
        for p in (0, 3, T - 1):
            _, resid = model.run_with_resid(tokens[:, :p + 1])
            last = model.resid_last(tokens[:, :p + 1], k)
            torch.testing.assert_close(last, resid[k][:, p], rtol=0, atol=1e-12)
            u = torch.randn_like(last)
            g_full = torch.autograd.grad((resid[k][:, p] * u).sum(), params, allow_unused=True)
            g_last = torch.autograd.grad((last * u).sum(), params, allow_unused=True)
            for a, b in zip(g_full, g_last):
                if a is None or b is None:
                    assert (a is None or not a.any()) and (b is None or not b.any())
                else:
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_checked_sites_sorts_dedupes_and_checks():
    assert checked_sites([Site(2, 3), Site(0, 1), Site(2, 3)], n_layer=2, n_pos=4) == [Site(0, 1), Site(2, 3)]
    with pytest.raises(ValueError, match="layer must be in 0..2"):
        checked_sites([Site(3, 0)], n_layer=2, n_pos=4)
    with pytest.raises(ValueError, match="pos must be in 0..3"):
        checked_sites([Site(1, 4)], n_layer=2, n_pos=4)
