"""TransformerLens habits kept: ``hook_normalized`` before the LayerNorm's affine, ``names_filter``, negative layer
indices in the cache, and directions saved with ``torch.save`` or shaped [1, d]; a zero direction refused."""

import numpy as np
import pytest
import torch

from ntpflow import GPT, GPTConfig, Site
from ntpflow.cli import main
from ntpflow.replay.directions import direction_probes, parse_direction, read_vector

EPS = 1e-5


def model_with_affine(**kw) -> GPT:
    """A small GPT whose LayerNorms have random weights and biases (the affine matters)."""
    model = GPT(GPTConfig(vocab_size=13, n_ctx=9, n_layer=2, n_head=2, d_model=16, layer_norm_eps=EPS, **kw), seed=1)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith("ln_final"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.double().eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 13, (3, 9), generator=torch.Generator().manual_seed(0))


def by_hand(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the last axis (biased variance, as LayerNorm's)."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS)


# ---------------------------------------------------------------- hook_normalized


@pytest.mark.parametrize("groups", [None, "untied"])
def test_hook_normalized_is_before_the_affine_as_in_transformerlens(groups):
    model = model_with_affine(position_groups=groups)
    with torch.no_grad():
        plain = model(tokens())
        logits, cache = model.run_with_cache(tokens(), names_filter=lambda name: "pattern" not in name)
    # caching leaves the forward's bits (a cached attention pattern would take the explicit softmax: equal to rounding)
    assert torch.equal(logits, plain)
    last = model.cfg.n_layer - 1
    for name, x in [("blocks.0.ln1.hook_normalized", cache["blocks.0.hook_resid_pre"]),
                    ("blocks.1.ln2.hook_normalized", cache["blocks.1.hook_resid_mid"]),
                    ("ln_final.hook_normalized", cache[f"blocks.{last}.hook_resid_post"])]:
        assert (cache[name] - by_hand(x)).abs().max() < 1e-12, name
    ln = model.blocks[0].ln1  # and not the value after it (they differ here)
    assert (cache["blocks.0.ln1.hook_normalized"] - ln.normalize(cache["blocks.0.hook_resid_pre"], None if groups is None
                                                                 else model._groups(9))).abs().max() > 0.1


def test_hook_normalized_matches_the_hooked_transformer():
    model = model_with_affine()
    with torch.no_grad():
        _, ours = model.run_with_cache(tokens())
        _, theirs = model.to_hooked_transformer().run_with_cache(tokens())
    for name in ("blocks.0.ln1.hook_normalized", "blocks.1.ln2.hook_normalized", "ln_final.hook_normalized"):
        assert (ours[name] - theirs[name]).abs().max() < 1e-10, name


def test_a_hook_on_hook_normalized_replaces_the_value_before_the_affine():
    model = model_with_affine()
    ln = model.blocks[0].ln1
    seen = {}

    def zero(act, hook):
        seen["act"] = act
        return torch.zeros_like(act)

    out = {}
    h1 = ln.hook_normalized.add_hook(zero)
    h2 = ln.register_forward_hook(lambda _m, _i, o: out.setdefault("ln", o))
    with torch.no_grad():
        model(tokens())
    h1.remove(), h2.remove()
    assert torch.equal(out["ln"], ln.bias[0].expand_as(out["ln"]))  # 0 * weight + bias

    def zero_first_in_place(act, hook):
        act[:, 0] = 0.0
        return act

    h1 = ln.hook_normalized.add_hook(zero_first_in_place)
    h2 = ln.register_forward_hook(lambda _m, _i, o: out.__setitem__("ln", o))
    with torch.no_grad():
        model(tokens())
    h1.remove(), h2.remove()
    assert torch.equal(out["ln"][:, 0], ln.bias[0].expand_as(out["ln"][:, 0]))  # an in-place change counts too
    assert not torch.equal(out["ln"][:, 1], ln.bias[0].expand_as(out["ln"][:, 1]))


# ---------------------------------------------------------------- names_filter and negative indices


def test_names_filter_takes_a_name_a_list_or_a_callable():
    model = model_with_affine()
    with torch.no_grad():
        plain = model(tokens())
        logits, one = model.run_with_cache(tokens(), names_filter="blocks.1.hook_resid_post")
        _, some = model.run_with_cache(tokens(), names_filter=["hook_embed", "blocks.0.attn.hook_pattern"])
        _, resid = model.run_with_cache(tokens(), names_filter=lambda name: name.endswith("resid_pre"))
        _, everything = model.run_with_cache(tokens())
    assert torch.equal(logits, plain)
    assert set(one) == {"blocks.1.hook_resid_post"}
    assert set(some) == {"hook_embed", "blocks.0.attn.hook_pattern"}
    assert set(resid) == {"blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"}
    for cache in (one, some, resid):
        assert all((v - everything[k]).abs().max() < 1e-12 for k, v in cache.items())
    with pytest.raises(ValueError, match="unknown hook points"):
        model.run_with_cache(tokens(), names_filter=["blocks.7.hook_resid_post"])


def test_negative_layers_count_from_the_end():
    model = model_with_affine()
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
        _, last = model.run_with_cache(tokens(), names_filter="blocks.1.hook_resid_post")
    assert cache["resid_post", -1] is cache["blocks.1.hook_resid_post"]
    assert cache["resid_pre", -2] is cache["blocks.0.hook_resid_pre"]
    assert cache["pattern", -1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["normalized", -1, "ln2"] is cache["blocks.1.ln2.hook_normalized"]
    assert cache["normalized"] is cache["ln_final.hook_normalized"]
    assert (last["resid_post", -1] - cache["blocks.1.hook_resid_post"]).abs().max() < 1e-12  # the model's layers
    with pytest.raises(KeyError):
        cache["resid_post", -3]


# ---------------------------------------------------------------- directions


def test_directions_from_pt_files_and_row_vectors(tmp_path):
    v = torch.randn(32, generator=torch.Generator().manual_seed(0))
    torch.save(v, tmp_path / "v.pt")
    torch.save({"das": v[None], "other": torch.ones(3)}, tmp_path / "d.pt")
    np.save(tmp_path / "row.npy", v[None].numpy())
    assert torch.equal(read_vector(tmp_path / "v.pt"), v)
    assert torch.equal(read_vector((tmp_path / "d.pt", "das")), v)
    assert torch.equal(read_vector(tmp_path / "row.npy"), v)
    assert torch.equal(read_vector(v[None]), v)
    assert parse_direction(f"w=1:3:{tmp_path}/d.pt:das") == ("w", Site(1, 3), f"{tmp_path}/d.pt", "das")
    probes = direction_probes({"a": (Site(1, 3), tmp_path / "v.pt"), "b": (Site(1, 3), (tmp_path / "d.pt", "das"))},
                              n_layer=1, n_pos=4, d_model=32)
    assert all(torch.equal(p.w, v) for p in probes)
    for source, match in [((tmp_path / "d.pt", None), "name the vector in it"), ((tmp_path / "d.pt", "nope"),
                          "no tensor under key 'nope'"), ((tmp_path / "v.pt", "k"), "no KEY"),
                          (torch.ones(2, 32), "one vector")]:
        with pytest.raises(ValueError, match=match) as e:
            read_vector(source)
        assert "\n" not in str(e.value)


def test_a_zero_direction_is_refused_before_anything_is_written(tmp_path, capsys):
    from ntpflow import TrainConfig, train

    with pytest.raises(ValueError, match="all zeros"):
        direction_probes({"z": (Site(1, 3), torch.zeros(32))}, n_layer=1, n_pos=4, d_model=32)
    run = train(TrainConfig(task="majority", device="cpu", n_layer=1, d_model=32, n_head=2, steps=2, batch_size=16,
                            n_train=64, n_eval=32, eval_every=2, ckpt_every=2, log_every=2), tmp_path / "run",
                progress=False)
    torch.save(torch.zeros(1, 32), tmp_path / "z.pt")
    out = tmp_path / "att"
    assert main(["attribute", str(run.dir), "--direction", f"z=1:3:{tmp_path / 'z.pt'}", "--out", str(out),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "all zeros" in err, err
    assert not out.exists()
