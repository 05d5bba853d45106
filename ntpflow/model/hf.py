"""Lossless conversion between ntpflow's ``GPT`` (one position group) and ``transformers.GPT2LMHeadModel``, and
from it to a TransformerLens ``HookedTransformer``.

HF's Conv1D stores weights as [d_in, d_out]; ntpflow stores [group, d_out, d_in].
"""

import torch

from ntpflow.model.config import GPTConfig

_BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_BLOCK_NORMS = {"ln1": "ln_1", "ln2": "ln_2"}


def _name_pairs(n_layer: int):
    """Yield (ntpflow name, HF name, is_conv1d_weight)."""
    yield "wte", "transformer.wte.weight", False
    yield "wpe", "transformer.wpe.weight", False
    for k in range(n_layer):
        for ours, theirs in _BLOCK_NORMS.items():
            for p in ("weight", "bias"):
                yield f"blocks.{k}.{ours}.{p}", f"transformer.h.{k}.{theirs}.{p}", False
        for lin in _BLOCK_LINEARS:
            yield f"blocks.{k}.{lin}.weight", f"transformer.h.{k}.{lin}.weight", True
            yield f"blocks.{k}.{lin}.bias", f"transformer.h.{k}.{lin}.bias", False
    for p in ("weight", "bias"):
        yield f"ln_final.{p}", f"transformer.ln_f.{p}", False


def gpt_to_hf(model):
    """A ``GPT2LMHeadModel`` (eval mode, tied embeddings) with the weights of ``model`` (one position group)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.cfg
    if cfg.n_groups != 1:
        raise ValueError("only a model with one position group converts to GPT2LMHeadModel")
    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.n_ctx, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=cfg.layer_norm_eps, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )
    hf_cfg._attn_implementation = "eager"
    hf = GPT2LMHeadModel(hf_cfg).to(dtype=model.wte.dtype)
    ours = dict(model.named_parameters())
    state = {theirs: (ours[name][0].T if conv else ours[name][0]).detach().clone()
             for name, theirs, conv in _name_pairs(cfg.n_layer)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF conversion mismatch: missing={missing} unexpected={unexpected}")
    hf.tie_weights()
    return hf.eval()


def gpt_from_hf(cls, hf_model, **overrides):
    """A ``cls`` (GPT) with the weights of the GPT-2 ``hf_model``; ``overrides`` go to GPTConfig."""
    c = hf_model.config
    if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported activation {c.activation_function!r}; ntpflow uses GELU (tanh)")
    cfg = GPTConfig(vocab_size=c.vocab_size, n_ctx=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                    d_model=c.n_embd, layer_norm_eps=c.layer_norm_epsilon, **overrides)
    model = cls(cfg)
    theirs = hf_model.state_dict()
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, hf_name, conv in _name_pairs(cfg.n_layer):
            w = theirs[hf_name]
            params[name].copy_((w.T if conv else w).expand_as(params[name]))
    return model.to(dtype=next(hf_model.parameters()).dtype)


def load_hf_gpt2(name_or_path: str):
    """``GPT2LMHeadModel.from_pretrained(name_or_path)`` in eval mode; ValueError (one line) if it cannot be read."""
    from transformers import GPT2LMHeadModel

    try:
        return GPT2LMHeadModel.from_pretrained(name_or_path).eval()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a GPT-2 model from {name_or_path!r}: {str(e).splitlines()[0]}") from None


def gpt_to_hooked_transformer(model):
    """A TransformerLens ``HookedTransformer`` with the weights of ``model`` (one position group), through its HF
    twin and TransformerLens's own GPT-2 weight conversion, unprocessed (no LayerNorm folding), so the logits match."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    cfg = model.cfg
    tl_cfg = HookedTransformerConfig(
        n_layers=cfg.n_layer, d_model=cfg.d_model, d_head=cfg.d_head, n_heads=cfg.n_head, d_mlp=4 * cfg.d_model,
        d_vocab=cfg.vocab_size, n_ctx=cfg.n_ctx, act_fn="gelu_new", normalization_type="LN", eps=cfg.layer_norm_eps,
        default_prepend_bos=False, dtype=model.wte.dtype, device=str(model.wte.device))
    tl = HookedTransformer(tl_cfg)
    tl.load_state_dict(convert_gpt2_weights(gpt_to_hf(model), tl_cfg), strict=False)
    return tl.eval()
