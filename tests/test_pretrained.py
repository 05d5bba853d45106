"""A GPT in the formats of the field: transformers' GPT-2 folder and TransformerLens's HookedTransformer."""

import pytest
import torch

from ntpflow import GPT, GPTConfig, TrainConfig, train
from ntpflow.runs.run import Run

EPS = torch.finfo(torch.float64).eps


def tiny(**kw) -> GPT:
    cfg = GPTConfig(vocab_size=13, n_ctx=9, n_layer=2, n_head=2, d_model=16, **kw)
    return GPT(cfg, seed=3).double().eval()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float64 rounding: a few hundred eps of the logits' scale (the same sums, in another order)."""
    return (a - b).abs().max().item() <= 256 * EPS * max(1.0, b.abs().max().item())


def test_save_pretrained_is_a_transformers_folder_and_from_pretrained_reads_it_back(tmp_path):
    from transformers import GPT2LMHeadModel

    model, tokens = tiny(), torch.randint(0, 13, (4, 9), generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "m")
    assert {"model.safetensors", "config.json"} <= {p.name for p in (tmp_path / "m").iterdir()}
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "m").double().eval()
    with torch.no_grad():
        assert close(hf(tokens).logits, model(tokens))
        assert torch.equal(GPT.from_pretrained(str(tmp_path / "m")).double()(tokens), model(tokens))  # exact copy


def test_hooked_transformer_has_the_same_logits_and_residuals_under_tl_names():
    model, tokens = tiny(), torch.randint(0, 13, (4, 9), generator=torch.Generator().manual_seed(1))
    tl = model.to_hooked_transformer()
    with torch.no_grad():
        logits, resid = model(tokens, return_resid=True)
        tl_logits, cache = tl.run_with_cache(tokens)
    assert close(tl_logits, logits)
    for k in range(2):  # resid[k] is the input of block k: TL's blocks.k.hook_resid_pre, [batch, pos, d_model]
        assert close(cache["resid_pre", k], resid[k])
    assert close(cache["resid_post", 1], resid[2])


def test_untied_model_does_not_convert_and_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="one position group"):
        tiny(position_groups="untied").save_pretrained(tmp_path / "u")
    assert not (tmp_path / "u").exists()
    with pytest.raises(ValueError, match="cannot load a GPT-2 model from") as e:
        GPT.from_pretrained(str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value)


def test_run_export_writes_the_final_weights(tmp_path):
    run = train(TrainConfig(task="majority", n_layer=1, d_model=32, n_head=2, steps=4, batch_size=32, n_train=256,
                            n_eval=128, eval_every=2, ckpt_every=2, log_every=2, device="cpu"), tmp_path / "run",
                progress=False)
    from transformers import GPT2LMHeadModel

    out = Run.open(run.dir).export(tmp_path / "hf")
    tokens = torch.as_tensor(run.datasets()[1].tokens[:8])
    with torch.no_grad():
        ours = run.load_model("final")(tokens)
        assert torch.equal(GPT.from_pretrained(str(out))(tokens), ours)
        theirs = GPT2LMHeadModel.from_pretrained(out).eval()(tokens).logits  # transformers reads the run's model
    eps32 = torch.finfo(torch.float32).eps
    assert (theirs - ours).abs().max().item() <= 256 * eps32 * max(1.0, ours.abs().max().item())


def test_run_with_cache_speaks_transformerlens():
    model, tokens = tiny(), torch.randint(0, 13, (4, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, ours = model.run_with_cache(tokens)
        _, theirs = model.to_hooked_transformer().run_with_cache(tokens)
    shared = sorted(set(ours) & set(theirs.keys()))
    assert {"hook_embed", "hook_pos_embed", "blocks.0.mlp.hook_pre", "blocks.1.attn.hook_pattern"} <= set(shared)
    for name in shared:  # the same activation under the same name, in the same shape
        assert ours[name].shape == theirs[name].shape, name
        assert close(ours[name], theirs[name]), name
    assert torch.equal(ours["resid_pre", 1], ours["blocks.1.hook_resid_pre"])
    assert torch.equal(ours["pattern", 0], ours["blocks.0.attn.hook_pattern"])
    assert torch.equal(ours["post", 1], ours["blocks.1.mlp.hook_post"]) and ours["embed"] is ours["hook_embed"]
