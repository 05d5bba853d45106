"""Shape-annotated tensor types of the public tensor APIs (jaxtyping; annotations only, nothing checks them at run
time). A type checker reads each as ``torch.Tensor``; a reader reads the axes.

Axes: ``batch`` sequences, ``pos`` positions (logits at p predict token p+1), ``vocab`` tokens, ``d_model`` the
residual width, ``n_params`` a model's parameters flattened (``ntpflow.engine``'s component vectors).
"""

import torch
from jaxtyping import Bool, Float, Int

Tokens = Int[torch.Tensor, "batch pos"]
Logits = Float[torch.Tensor, "batch pos vocab"]
Resid = Float[torch.Tensor, "batch pos d_model"]
ResidLast = Float[torch.Tensor, "batch d_model"]
FlatParams = Float[torch.Tensor, "n_params"]
Mask = Bool[torch.Tensor, "batch pos"]
Labels = Int[torch.Tensor, "batch pos"]  # per-position type labels (Othello square types)
Rows = Int[torch.Tensor, "batch"]  # indices of a batch's sequences in a dataset

__all__ = ["FlatParams", "Labels", "Logits", "Mask", "Resid", "ResidLast", "Rows", "Tokens"]
