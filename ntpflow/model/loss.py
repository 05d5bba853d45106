"""The one language-modelling loss used by training, evaluation and attribution."""

import torch
import torch.nn.functional as F


def per_position_loss(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor | None = None):
    """Per-position batch-mean cross-entropy of predicting token p+1 from logits at position p.

    Args:
        logits: [batch, pos, vocab]; tokens: [batch, pos]; loss_mask: bool [batch, pos], whether the prediction
            at p counts (None: all positions 0..T-2 count). The last position has no target and never counts.
    Returns:
        (loss [pos-1], counted [pos-1] bool): mean over the unmasked batch rows at each position; positions with no
        unmasked row give 0 and ``counted=False``.
    """
    logits, targets = logits[:, :-1], tokens[:, 1:]
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [batch, pos-1]
    if loss_mask is None:
        return ce.mean(0), torch.ones(ce.shape[1], dtype=torch.bool, device=ce.device)
    mask = loss_mask[:, :-1].to(ce.dtype)
    n = mask.sum(0)
    return (ce * mask).sum(0) / n.clamp(min=1), n > 0


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar training loss: the mean over counted positions of ``per_position_loss`` (shapes as there)."""
    per_pos, counted = per_position_loss(logits, tokens, loss_mask)
    return per_pos.sum() / counted.sum().clamp(min=1)
