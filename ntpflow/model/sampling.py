"""Sampling continuations from a ``ntpflow.GPT``: temperature, top-k and greedy decoding, seeded and deterministic.

Convention (as in ``ntpflow.model.gpt``): the logits at position p predict token p+1, so the next token after a context
of length t is drawn from the logits at position t-1. There is no ``<bos>`` handling here: the prompt is used as
given. A context longer than the model's ``n_ctx`` is cropped to its last ``n_ctx`` tokens (a sliding window; the
kept tokens then sit at positions 0..n_ctx-1). A myopic model samples exactly like its ordinary twin, since myopic
attention changes gradients, never forward values; the forward here runs with ``myopic="none"``.

Randomness comes only from the ``torch.Generator`` passed in (a CPU generator; probabilities are moved to the CPU
for the draw), so the same model, prompt, settings and generator seed give the same tokens on any device whose
logits agree.
"""

from __future__ import annotations

import torch

from ntpflow.model.gpt import GPT

__all__ = ["next_token_probs", "sample"]


def next_token_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """Sampling distribution of the next token.

    Args:
        logits: [batch, vocab] logits of the last position.
        temperature: > 0; logits are divided by it.
        top_k: keep only the ``top_k`` largest logits (ties at the k-th value are kept); None or >= vocab keeps all.
    Returns:
        [batch, vocab] float32 probabilities (rows sum to 1).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (use greedy=True for argmax), got {temperature}")
    x = logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if top_k < x.shape[-1]:
            kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
    return torch.softmax(x, dim=-1)


@torch.no_grad()
def sample(model: GPT, prompt, n_new: int, *, temperature: float = 1.0, top_k: int | None = None,
           greedy: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``prompt`` by ``n_new`` tokens.

    Args:
        model: the GPT (any regime); put in eval mode for the call and restored after.
        prompt: token ids, [t] or [batch, t] (a tensor, list or array), 1 <= t; ids must be < vocab_size.
        n_new: number of tokens to generate (>= 0).
        temperature, top_k: see :func:`next_token_probs`.
        greedy: take the argmax (temperature and top_k ignored, no randomness).
        generator: CPU ``torch.Generator`` for the draws; required unless ``greedy`` (explicit seeding).
    Returns:
        int64 tokens on the CPU, [t + n_new] or [batch, t + n_new] (same rank as ``prompt``): the prompt followed by
        the generated tokens. The model only ever sees the last ``n_ctx`` tokens.
    """
    tokens = torch.as_tensor(prompt, dtype=torch.long).cpu()
    squeeze = tokens.dim() == 1
    if squeeze:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"prompt must be [t] or [batch, t] with t >= 1, got shape {tuple(tokens.shape)}")
    if n_new < 0:
        raise ValueError(f"n_new must be >= 0, got {n_new}")
    vocab, n_ctx = model.cfg.vocab_size, model.cfg.n_ctx
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"prompt token ids must lie in 0..{vocab - 1}")
    if not greedy and generator is None:
        raise ValueError("sampling needs an explicit torch.Generator (or greedy=True)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for _ in range(n_new):
            ctx = tokens[:, -n_ctx:].to(device)
            logits = model(ctx, myopic="none")[:, -1]  # [batch, vocab]: predicts the token after ctx
            if greedy:
                nxt = logits.argmax(-1).cpu()
            else:
                probs = next_token_probs(logits, temperature, top_k).cpu()
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
    finally:
        model.train(was_training)
    return tokens[0] if squeeze else tokens
