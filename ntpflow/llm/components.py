"""Building blocks shared by the LLM experiment and ``ntpflow qscan``: the tiny test model, SAE storage, a quick
SimpleSAE trainer, model loading by name.

* :func:`tiny_gpt2`: a random Hugging Face GPT-2 (2 layers, width 32) over a byte-level tokenizer
  (:class:`ByteTokenizer`), for CI: it checks the pipeline, not the science.
* :func:`train_simple_sae`: a few hundred Adam steps on a :class:`~ntpflow.llm.sae.SimpleSAE` (TopK) - no sae-lens.
* :func:`save_sae_dir` / :func:`load_sae_dir`: one folder format for both SAE kinds (``simple_sae.pt`` +
  ``simple_sae.json`` for a SimpleSAE, the sae-lens inference format otherwise).
* :func:`load_model`: ``"smollm2"`` (offline SmolLM2-135M-Instruct) or ``"tiny"``.

Heavy dependencies (``transformers``, ``sae_lens``) are imported lazily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ntpflow.files import resolve_device as _resolve
from ntpflow.llm.adapters import HFAdapter, LoadedModel, load_smollm2
from ntpflow.llm.sae import SimpleSAE, load_sae

MODELS = ("smollm2", "tiny")


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


def tiny_gpt2(seed: int = 0, device: str | torch.device = "cpu", n_ctx: int = 128) -> Any:
    """A random ``transformers.GPT2LMHeadModel`` (2 layers, d_model 32, 2 heads, byte vocabulary) wrapped as a
    :class:`~ntpflow.llm.adapters.LoadedModel`; site ``blocks.0.hook_resid_post``. Seeded, offline."""
    from transformers import GPT2Config, GPT2LMHeadModel


    cfg = GPT2Config(vocab_size=ByteTokenizer.vocab_size, n_positions=n_ctx, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(cfg)
    model = model.to(device).eval()
    return LoadedModel(HFAdapter(model), ByteTokenizer(), 1, "blocks.0.hook_resid_post", "tiny-random-gpt2")


def load_model(name: str, device: str | torch.device = "cpu", seed: int = 0) -> Any:
    """``"smollm2"`` (offline SmolLM2-135M-Instruct) or ``"tiny"`` (:func:`tiny_gpt2`) as a ``LoadedModel``."""
    if name == "smollm2":
        return load_smollm2(device)
    if name == "tiny":
        return tiny_gpt2(seed, device)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``; other values checked (:func:`ntpflow.files.resolve_device`)
    and returned as a string."""
    return str(_resolve(device))


def train_simple_sae(acts: torch.Tensor, d_sae: int, k: int = 8, steps: int = 300, batch_size: int = 256,
                     lr: float = 3e-3, seed: int = 0) -> tuple[Any, dict]:
    """Train a TopK :class:`~ntpflow.llm.sae.SimpleSAE` on ``acts`` ``[N, d_in]`` with Adam on the MSE.

    Decoder rows are renormalised to unit norm after every step; ``b_dec`` starts at the data mean. Returns
    ``(sae, info)`` with the final loss. Seeded (initialisation and batch order).
    """
    acts = acts.float()
    n, d_in = acts.shape
    sae = SimpleSAE(d_in, d_sae, k=k, seed=seed)
    with torch.no_grad():
        sae.b_dec.copy_(acts.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = acts[torch.randint(0, n, (min(batch_size, n),), generator=gen)]
        loss = ((sae(x) - x) ** 2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            sae.W_dec.div_(sae.W_dec.norm(dim=1, keepdim=True).clamp(min=1e-8))
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae, {"final_loss": float(loss.detach()), "config": {"d_sae": d_sae, "k": k, "steps": steps,
                                                        "batch_size": batch_size, "lr": lr, "seed": seed}}


def save_sae_dir(sae: Any, path: str | Path) -> None:
    """Save a SimpleSAE (``simple_sae.pt`` + ``simple_sae.json``) or an sae-lens SAE (its inference format) into
    the folder ``path``, written to a temporary sibling first and renamed (atomic)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if isinstance(sae, SimpleSAE):
        torch.save(sae.state_dict(), tmp / "simple_sae.pt")
        (tmp / "simple_sae.json").write_text(json.dumps({"d_in": sae.d_in, "d_sae": sae.d_sae, "k": sae.k}))
    else:
        sae.save_inference_model(str(tmp))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)


def load_sae_dir(path: str | Path, device: str = "cpu") -> Any:
    """Load an SAE saved by :func:`save_sae_dir` (or by :func:`ntpflow.llm.sae.save_sae`)."""
    path = Path(path)
    if (path / "simple_sae.json").exists():
        meta = json.loads((path / "simple_sae.json").read_text())
        sae = SimpleSAE(meta["d_in"], meta["d_sae"], k=meta["k"])
        sae.load_state_dict(torch.load(path / "simple_sae.pt", map_location=device))
        for p in sae.parameters():
            p.requires_grad_(False)
        return sae.to(device).eval()
    if (path / "cfg.json").exists():
        return load_sae(str(path), device=device)
    raise FileNotFoundError(f"no SAE in {path} (expected simple_sae.json or an sae-lens cfg.json)")


def encoder_matrix(sae: Any) -> torch.Tensor:
    """The SAE's encoder ``W_enc`` as ``[d_in, d_sae]`` (float32, CPU)."""
    W = getattr(sae, "W_enc", None)
    if W is None:
        raise TypeError(f"SAE object {type(sae).__name__} has no W_enc")
    return W.detach().float().cpu()
