"""R GPTs of one architecture as one module with a leading run axis on every parameter."""

import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

from ntpflow.model.gpt import GPT
from ntpflow.model.loss import lm_loss


class RunStack(nn.Module):
    """R GPTs of one architecture as one module: parameter ``name`` of run r is ``self.stacked[i][r]``.

    ``forward(tokens [R, batch, pos]) -> logits [R, batch, pos, vocab]``, run r on its own weights and batch.
    """

    groups: torch.Tensor  # buffer: the runs' shared position groups (GPT.groups)

    def __init__(self, models: Sequence[GPT]):
        super().__init__()
        cfg = models[0].cfg
        if any(m.cfg != cfg for m in models):
            raise ValueError("the runs of a group must share one architecture")
        self.names = [n for n, _ in models[0].named_parameters()]
        self.stacked = nn.ParameterList(
            nn.Parameter(torch.stack([m.get_parameter(n).detach() for m in models])) for n in self.names)
        self.register_buffer("groups", models[0].groups.clone(), persistent=False)
        self._template = [GPT(cfg).to("meta")]  # a list: not a submodule, holds no memory; supplies the forward

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [R, batch, pos] -> logits [R, batch, pos, vocab]."""
        return self._vmap(self._one, tokens)

    def losses(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Each run's ``lm_loss`` on its own batch: tokens, loss_mask [R, batch, pos] -> [R]."""
        return self._vmap(lambda params, tok, mask: lm_loss(self._one(params, tok), tok, mask), tokens, loss_mask)

    def _one(self, params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """One run's logits [batch, pos, vocab] from its parameters (no run axis) and tokens [batch, pos]."""
        return functional_call(self._template[0], (params, {"groups": self.groups}), (tokens,))

    def _vmap(self, fn, *tensors: torch.Tensor) -> torch.Tensor:
        """``fn(params, *tensors)`` mapped over the run axis of the parameters and of ``tensors``."""
        with warnings.catch_warnings():  # the CPU attention kernel has no batching rule: vmap loops over the runs
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
            return vmap(fn)(dict(zip(self.names, self.stacked)), *tensors)

    @torch.no_grad()
    def finite(self) -> torch.Tensor:
        """Whether each run's weights are all finite: [R] bool (no sync)."""
        return torch.stack([torch.isfinite(s).flatten(1).all(1) for s in self.stacked]).all(0)

    def member(self, r: int) -> dict[str, torch.Tensor]:
        """Run r's parameters by name (views of the stacked ones)."""
        return {n: s[r] for n, s in zip(self.names, self.stacked)}
