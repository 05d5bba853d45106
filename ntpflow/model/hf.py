"""Lossless conversion between ntpflow's ``GPT`` (one position group) and ``transformers.GPT2LMHeadModel``, and
from it to a TransformerLens ``HookedTransformer``.

HF's Conv1D stores weights as [d_in, d_out]; ntpflow stores [group, d_out, d_in].
"""

from pathlib import Path

import torch

from ntpflow.files import load_tensors, read_json
from ntpflow.model.config import GPTConfig
from ntpflow.model.weights import check_tensors

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
    # transformers wraps PreTrainedModel.to in a decorator that pyright reads as unbound
    hf = GPT2LMHeadModel(hf_cfg).to(dtype=model.wte.dtype)  # pyright: ignore[reportCallIssue]
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
    return gpt_from_hf_state(cls, hf_model.config.to_dict(), hf_model.state_dict(), "the GPT-2 model", **overrides)


_SKIPPED = (".attn.bias", ".attn.masked_bias")  # the causal-mask buffers of older transformers versions


def gpt_from_hf_state(cls, config: dict, state: dict[str, torch.Tensor], where: str, **overrides):
    """A ``cls`` (GPT) from a GPT-2 ``config`` (``config.json`` as a dict) and its tensors ``state`` (names of
    ``GPT2LMHeadModel`` or, without ``transformer.``, of ``GPT2Model``), in their dtype; ``overrides`` go to
    GPTConfig. Every tensor is checked (names, shapes, dtype): a one-line ValueError naming the first bad one."""
    if config.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{where}: a {config['model_type']!r} model, not GPT-2")
    missing = [k for k in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd") if k not in config]
    if missing:
        raise ValueError(f"{where}: its config has no {missing[0]}; not a GPT-2 config")
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported activation {config['activation_function']!r}; ntpflow uses GELU (tanh)")
    cfg = GPTConfig(vocab_size=config["vocab_size"], n_ctx=config["n_positions"], n_layer=config["n_layer"],
                    n_head=config["n_head"], d_model=config["n_embd"],
                    layer_norm_eps=config.get("layer_norm_epsilon", 1e-5), **overrides)
    model = cls(cfg)
    params = dict(model.named_parameters())
    shapes = {theirs: tuple(params[name].shape[1:][::-1] if conv else params[name].shape[1:])
              for name, theirs, conv in _name_pairs(cfg.n_layer)}
    state = {(f"transformer.{k}" if f"transformer.{k}" in shapes else k): v
             for k, v in state.items() if not k.endswith(_SKIPPED)}
    head = state.pop("lm_head.weight", None)
    check_tensors(shapes, state, where)
    if head is not None and not torch.equal(head, state["transformer.wte.weight"]):
        raise ValueError(f"{where}: lm_head.weight differs from the token embedding; ntpflow's GPT ties them")
    with torch.no_grad():
        for name, hf_name, conv in _name_pairs(cfg.n_layer):
            w = state[hf_name]
            params[name].copy_((w.T if conv else w).expand_as(params[name]))
    return model.to(dtype=state["transformer.wte.weight"].dtype)


HF_CONFIG, HF_WEIGHTS, TL_CONFIG = "config.json", "model.safetensors", "tl_config.json"  # a folder's files


def _run_config(path: Path) -> dict | None:
    """The ``config.json`` of an ntpflow run folder (it holds ``train`` and ``model``), or None for any other path."""
    try:
        config = read_json(path / HF_CONFIG) if (path / HF_CONFIG).is_file() else None
    except ValueError:
        return None
    return config if isinstance(config, dict) and isinstance(config.get("train"), dict) else None


def _from_run_folder(cls, path: Path, config: dict, **overrides):
    """A run folder's final model (``model.safetensors``: weights alone, or an older version's weights + optimizer
    state under ``model.`` and ``adam.`` names), checked tensor by tensor; an unfinished run is a one-line ValueError
    naming its checkpoints. ``config``: the folder's ``config.json`` (:func:`_run_config`). Read by file here, so
    that the model layer does not need the run layer."""
    from dataclasses import replace

    weights = path / HF_WEIGHTS
    if not weights.exists():
        raise ValueError(f"{path} is a run folder without final weights (its training has not finished): train it to "
                         f"the end, or load a checkpoint with Run.open({str(path)!r}).load_model(STEP) (STEP one of "
                         f"Run.open({str(path)!r}).checkpoints())")
    cfg = GPTConfig(**config["model"])
    state = load_tensors(weights)
    if any(k.startswith("model.") for k in state):  # an older version's single file
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    model = cls(replace(cfg, **overrides))
    check_tensors({k: tuple(v.shape) for k, v in model.state_dict().items()}, state,
                  f"{weights} does not match the run's model")
    model.load_state_dict(state)
    return model


def gpt_from_pretrained(cls, name_or_path: str | Path, **overrides):
    """``GPT.from_pretrained``: a ``cls`` from an ntpflow run folder (its final weights), a GPT-2 folder written by
    ``save_pretrained`` (its tensors checked one by one), or a hub name; a one-line ValueError otherwise, saying
    what to call instead."""
    path = Path(name_or_path)
    if (config := _run_config(path)) is not None:
        return _from_run_folder(cls, path, config, **overrides)
    if path.is_dir():
        if (path / TL_CONFIG).exists():
            raise ValueError(f"{path} holds a TransformerLens model ({TL_CONFIG}): load it with "
                             f"ntpflow.llm.adapters.load_local({str(path)!r}); GPT.from_pretrained reads GPT-2 folders "
                             "and run folders")
        if not (path / HF_CONFIG).exists():
            raise ValueError(f"{path} holds no model: expected a run folder or a GPT-2 folder ({HF_CONFIG}, as "
                             "GPT.save_pretrained or Run.export write it)")
        if (path / HF_WEIGHTS).exists():
            config = read_json(path / HF_CONFIG)
            if not isinstance(config, dict):
                raise ValueError(f"{path / HF_CONFIG} is not a model config")
            return gpt_from_hf_state(cls, config, load_tensors(path / HF_WEIGHTS), str(path / HF_WEIGHTS), **overrides)
    elif path.exists():
        raise ValueError(f"{path} is a file; GPT.from_pretrained takes a folder (a run or a GPT-2 model) or a hub name")
    elif str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise ValueError(f"cannot load a GPT-2 model from {str(name_or_path)!r}: no such folder")
    return gpt_from_hf(cls, load_hf_gpt2(str(name_or_path)), **overrides)


def load_hf_gpt2(name_or_path: str):
    """``GPT2LMHeadModel.from_pretrained(name_or_path)`` in eval mode; ValueError (one line) if it cannot be read or
    leaves a tensor at its random initial value (one missing from the files)."""
    from transformers import GPT2LMHeadModel

    try:
        # output_loading_info=True returns (model, info); transformers' annotation names the model alone
        model, info = GPT2LMHeadModel.from_pretrained(  # pyright: ignore[reportGeneralTypeIssues]
            name_or_path, output_loading_info=True)
    except Exception as e:  # transformers, huggingface_hub and safetensors raise their own types
        lines = str(e).strip().splitlines() or [type(e).__name__]
        why = lines[0] if Path(name_or_path).exists() else f"no such folder, nor a hub model ({lines[0]})"
        raise ValueError(f"cannot load a GPT-2 model from {name_or_path!r}: {why}") from None
    missing = [k for k in info.get("missing_keys", ()) if k != "lm_head.weight" and not k.endswith(_SKIPPED)]
    bad = missing or list(info.get("mismatched_keys", ()))
    if bad:
        raise ValueError(f"cannot load a GPT-2 model from {name_or_path!r}: tensor {bad[0]!r} is missing or "
                         "mismatched in its files")
    return model.eval()


def gpt_to_hooked_transformer(model):
    """A TransformerLens ``HookedTransformer`` with the weights of ``model`` (one position group), through its HF
    twin and TransformerLens's own GPT-2 weight conversion, unprocessed (no LayerNorm folding), so the logits match."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    cfg = model.cfg
    tl_cfg = HookedTransformerConfig(
        n_layers=cfg.n_layer, d_model=cfg.d_model, d_head=cfg.d_head, n_heads=cfg.n_head, d_mlp=4 * cfg.d_model,
        d_vocab=cfg.vocab_size, n_ctx=cfg.n_ctx, act_fn="gelu_new", normalization_type="LN", eps=cfg.layer_norm_eps,
        default_prepend_bos=False, dtype=model.wte.dtype, device=str(model.wte.device))
    tl = HookedTransformer(tl_cfg)
    tl.load_state_dict(convert_gpt2_weights(gpt_to_hf(model), tl_cfg), strict=False)
    return tl.eval()
