"""Steering with SAE latents and a code-likeness score of the output (docs/paper.md#gemma).

Steering adds ``coef * W_dec[f]`` to the activation at the SAE's site at **every** position (prompt and generated
tokens; generation re-runs the whole sequence each step, so every position is steered every time). The coefficient is
applied **once**: the reference (``sae_steer.py``) builds ``steering_vector = coef * W_dec[f]`` and its hook adds
``coef * steering_vector``, so its effective scale is ``coef**2`` (1 and 100 for its coefficients 1 and 10); ntpflow
does not repeat that mistake.

Because decoder rows of different SAEs have different norms, :func:`steering_vectors` also offers a *relative*
coefficient: ``alpha * resid_norm * W_dec[f] / ||W_dec[f]||`` (a push of ``alpha`` times the typical residual norm).

Code-likeness (:func:`code_score`), the exact rule: over the non-whitespace characters of the generated text (the
continuation only, not the prompt), the share that are either ASCII punctuation (``string.punctuation``: brackets,
operators, quotes, ``.,:;`` ...) or letters of a word (a maximal ``[A-Za-z_][A-Za-z0-9_]*`` run) that is a Python
keyword (``keyword.kwlist``). An empty text scores 0. Prose scores low (a few commas and full stops), Python high.
"""

from __future__ import annotations

import keyword
import math
import re
import string
from collections.abc import Sequence
from typing import Any

import torch

_PUNCT = frozenset(string.punctuation)
_KEYWORDS = frozenset(keyword.kwlist)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def code_score(text: str) -> float:
    """Share of non-whitespace characters of ``text`` that are ASCII punctuation or belong to a Python keyword (see
    the module docstring); in ``[0, 1]``, 0 for an empty text."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    n_punct = sum(c in _PUNCT for c in chars)
    n_kw = sum(len(m.group()) for m in _WORD.finditer(text) if m.group() in _KEYWORDS)
    return (n_punct + n_kw) / len(chars)


def steering_vectors(sae: Any, latents: Sequence[int], coef: float, relative_to: float | None = None
                     ) -> torch.Tensor:
    """Steering vectors ``[S, d_in]``: ``coef * W_dec[f]`` (coefficient applied once), or with ``relative_to``
    (a residual norm) ``coef * relative_to * W_dec[f] / ||W_dec[f]||``."""
    W = sae.W_dec.detach().float().cpu()  # [d_sae, d_in]
    idx = torch.as_tensor(list(latents), dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= W.shape[0]):
        raise ValueError(f"latent ids must lie in [0, {W.shape[0]})")
    rows = W[idx]
    if relative_to is None:
        return coef * rows
    return coef * float(relative_to) * rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)


@torch.no_grad()
def generate(adapter: Any, prompt: torch.Tensor, hook: str, vectors: torch.Tensor | None, max_new_tokens: int = 20,
             temperature: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Continue ``prompt`` ``[B, T0]`` (same prompt length per row) by ``max_new_tokens`` tokens with
    ``vectors[b]`` (``[B, d]``; ``None``: no steering) added at ``hook`` at every position of row ``b``.

    ``temperature == 0`` is greedy; otherwise tokens are sampled from ``softmax(logits / temperature)`` with a
    generator seeded by ``seed``. Returns ``[B, T0 + max_new_tokens]`` (int64, CPU).
    """
    tokens = prompt.to(torch.long).cpu()
    if tokens.dim() != 2:
        raise ValueError(f"prompt must be [batch, seq], got shape {tuple(tokens.shape)}")
    if vectors is not None:
        if vectors.shape != (tokens.shape[0], adapter.d_model):
            raise ValueError(f"vectors must be [{tokens.shape[0]}, {adapter.d_model}], got {tuple(vectors.shape)}")
        adapter.check_hook(hook)
    gen = torch.Generator().manual_seed(seed)
    if getattr(adapter, "supports_prefix_cache", False) and hasattr(adapter, "_forward"):
        return _generate_cached(adapter, tokens, hook, vectors, max_new_tokens, temperature, gen)
    for _ in range(max_new_tokens):
        if vectors is None:
            logits = adapter.logits(tokens)
        else:
            def edit(act: torch.Tensor) -> torch.Tensor:
                return act + vectors.to(act.device, act.dtype)[:, None, :]

            logits = adapter.logits(tokens, hook=hook, edit=edit)
        last = logits[:, -1].float().cpu()  # [B, V]
        if temperature <= 0:
            nxt = last.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)[:, 0]
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens


def _pick(last: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Next tokens ``[B]`` from last-position logits ``[B, V]`` (greedy when ``temperature <= 0``)."""
    last = last.float().cpu()
    if temperature <= 0:
        return last.argmax(-1)
    return torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)[:, 0]


@torch.no_grad()
def _generate_cached(adapter: Any, tokens: torch.Tensor, hook: str, vectors: torch.Tensor | None,
                     max_new_tokens: int, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """:func:`generate` for a Hugging Face adapter with the key/value cache: the prompt once, then one token per
    step; the steering vector is added to every new position as it is computed, so every position is steered
    exactly as in the uncached loop."""
    def edit(act: torch.Tensor) -> torch.Tensor:
        assert vectors is not None  # edit is used only with vectors (fn below)
        return act + vectors.to(act.device, act.dtype)[:, None, :]

    fn = None if vectors is None else edit
    dev = adapter.device
    out = adapter._forward(hook if fn else None, fn, input_ids=tokens.to(dev), use_cache=True)
    cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    nxt = _pick(out.logits[:, -1], temperature, gen)
    tokens = torch.cat([tokens, nxt[:, None]], 1)
    for _ in range(max_new_tokens - 1):
        kw = {"past_key_values": cache} if adapter._cache_kw == "past_key_values" else {"cache": cache}
        out = adapter._forward(hook if fn else None, fn, input_ids=nxt[:, None].to(dev), use_cache=True, **kw)
        cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        nxt = _pick(out.logits[:, -1], temperature, gen)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens


def steer_latents(adapter: Any, tokenizer: Any, sae: Any, hook: str, latents: Sequence[int], prompts: Sequence[str],
                  bos_id: int, coef: float, relative_to: float | None = None, max_new_tokens: int = 20,
                  temperature: float = 0.0, n_samples: int = 1, seed: int = 0, batch_size: int = 32) -> dict:
    """Steer with each latent (and once without steering, the baseline) from each prompt, score the continuations.

    Args:
        adapter, tokenizer: the model and its tokenizer (``tokenizer(text, add_special_tokens=False)["input_ids"]``,
            ``tokenizer.decode(ids)``).
        sae: the SAE whose decoder rows steer.
        hook: the SAE's site.
        latents: latent ids ``[S]``.
        prompts: texts; ``""`` means BOS only (the reference's empty prompt). BOS is prepended to every prompt.
        bos_id: the BOS id.
        coef, relative_to: see :func:`steering_vectors`.
        max_new_tokens, temperature: see :func:`generate`.
        n_samples: continuations per (latent, prompt) (only useful when sampling).
        seed: sampling seed (sample ``j`` of prompt ``i`` uses ``seed + 1000 * i + j``).
        batch_size: rows per generation batch.

    Returns:
        ``{"latents": [S], "prompts": [...], "score": [S][P] mean code score over samples, "baseline": [P],
        "texts": [S][P] first sample's continuation, "baseline_texts": [P]}``.
    """
    lat = [int(x) for x in latents]
    vecs = steering_vectors(sae, lat, coef, relative_to)  # [S, d]
    rows = torch.cat([vecs, torch.zeros(1, vecs.shape[1])])  # last row: baseline
    S, P = len(lat), len(prompts)
    score = [[0.0] * P for _ in range(S + 1)]
    texts = [[""] * P for _ in range(S + 1)]
    for i, text in enumerate(prompts):
        ids = [bos_id] + list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for j in range(n_samples):
            for b0 in range(0, S + 1, batch_size):
                v = rows[b0:b0 + batch_size]
                prompt = torch.tensor(ids, dtype=torch.long)[None].expand(v.shape[0], -1)
                out = generate(adapter, prompt, hook, v, max_new_tokens, temperature, seed + 1000 * i + j)
                for r in range(v.shape[0]):
                    cont = tokenizer.decode(out[r, len(ids):].tolist(), skip_special_tokens=True)
                    score[b0 + r][i] += code_score(cont) / n_samples
                    if j == 0:
                        texts[b0 + r][i] = cont
    return {"latents": lat, "prompts": list(prompts), "score": score[:S], "baseline": score[S],
            "texts": texts[:S], "baseline_texts": texts[S], "coef": coef, "relative_to": relative_to,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "n_samples": n_samples, "seed": seed}


def pick_extremes(latents: Sequence[int], q: Sequence[float], included: Sequence[bool], n: int
                  ) -> tuple[list[int], list[int]]:
    """``(high, low)``: the ``n`` included latents with the largest and the smallest Q (disjoint; fewer when there
    are fewer than ``2 n`` included latents)."""
    pairs = sorted((float(qq), int(f)) for f, qq, ok in zip(latents, q, included) if ok and not math.isnan(float(qq)))
    n = min(n, len(pairs) // 2)
    low = [f for _, f in pairs[:n]]
    high = [f for _, f in pairs[len(pairs) - n:]][::-1]
    return high, low
