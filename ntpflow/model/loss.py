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


def position_weights(tokens: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weight of each position's cross-entropy in ``lm_loss`` of the whole batch ``tokens`` [batch, pos]: 1 / (its
    counted rows · the counted positions), 0 where nothing counts [pos-1] (so that :func:`lm_loss_part` of the parts of
    a batch sums to its ``lm_loss``)."""
    dtype = torch.float32 if tokens.device.type == "mps" else torch.float64  # MPS has no float64
    if loss_mask is None:
        n = torch.full((tokens.shape[1] - 1,), float(tokens.shape[0]), dtype=dtype, device=tokens.device)
    else:
        n = loss_mask[:, :-1].sum(0).to(dtype)
    counted = n > 0
    return torch.where(counted, 1.0 / (n.clamp(min=1) * counted.sum().clamp(min=1)), 0.0)


def lm_loss_part(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor | None,
                 weights: torch.Tensor) -> torch.Tensor:
    """A part of a batch's ``lm_loss``: Σ_b Σ_p mask_bp · ce_bp · weights_p over this part's rows (``weights`` [pos-1]
    from :func:`position_weights` of the whole batch); the parts' sum is the whole batch's ``lm_loss``."""
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")  # [rows, pos-1]
    if loss_mask is not None:
        ce = ce * loss_mask[:, :-1].to(ce.dtype)
    return (ce * weights.to(ce.dtype)).sum()
