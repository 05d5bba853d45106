"""The exact account of a replay, where θ* is known (``attribute --readout N``): the accumulators of the account
kept while training (:class:`ntpflow.engine.exact.ExactAccount`), each step's quadrature judged by the probes' own
risks.

Without θ* the account settles a step by what its rule integrates exactly (the readout's displacement and second
moment). A replay knows θ*'s readout residuals r*, so it judges each step as the probe rows need: every probe's R_H
and R_c (per type subset where the task has types), full − change against ``Readout.tolerance``, min(rtol · |change|,
cap · |R_H(θ_0)|) + floor · |R_H(θ_0)|. Its rows are its one-step chunks contracted with r* and the probes'
directions (``ntpflow.replay.from_account.account_rows``), its matrices the same chunks' ``chunk_matrices``.
"""

from collections.abc import Sequence

import torch

from ntpflow.engine.exact import ExactAccount, chunk_values, keyed
from ntpflow.engine.influence import Probe
from ntpflow.model.gpt import GPT
from ntpflow.model.shapes import Tokens
from ntpflow.model.sites import Site


class ReplayAccount(ExactAccount):
    """An :class:`ExactAccount` that knows θ*'s readout residuals ``final`` {site: [N, d]} and the ``probes``: a
    step is integrated again at the next rule while some probe's risk misses its exact change by more than its
    tolerance (module docstring). Its sites are the probes'; ``types`` {feature: [N, pos]} also judges each type
    subset of a probe of that feature. One step a chunk; other keywords as :class:`ExactAccount`'s; one process."""

    def __init__(self, model: GPT, opt: torch.optim.Optimizer, probes: Sequence[Probe], readout: Tokens,
                 final: dict[Site, torch.Tensor], **kw):
        super().__init__(model, opt, [p.site for p in probes], readout, chunk_steps=1, **kw)
        if self.shard.size > 1:
            raise ValueError("a replay's account runs in one process")
        dev = self.tokens.device
        self.r_star = {s: final[s].to(dev, torch.float64) for s in self.sites}
        self._judged: list[tuple[Site, torch.Tensor, tuple | None]] = []  # (site, directions [n, d], subset)
        for s in self.sites:
            mine = [p for p in probes if p.site == s]
            self._judged.append((s, torch.stack([p.w for p in mine]).to(dev, torch.float64), None))
            for p in mine:
                if p.name in self.types:
                    col = self.types[p.name][:, s.pos]
                    self._judged += [(s, p.w[None].to(dev, torch.float64), (p.name, t, col == t))
                                     for t in torch.unique(col).tolist()]
        self._risk0: torch.Tensor | None = None  # |R_H(θ_0)| of every judged risk [n_risks]

    def _excess(self, sink: dict, end: dict[Site, torch.Tensor]) -> float:
        """The worst risk's |full − change| over its tolerance (0 within), the step's integrals ``sink``."""
        assert self._resid is not None
        tensors = keyed(sink)
        for s in self.sites:
            tensors[f"start.{s.layer}:{s.pos}"], tensors[f"end.{s.layer}:{s.pos}"] = self._resid[s], end[s]
        values = [chunk_values(tensors, s, self.r_star[s], w, subset) for s, w, subset in self._judged]
        real = self._real_row()
        if self._risk0 is None:  # θ_0's risks: the first step's start
            self._risk0 = torch.cat([v["risk"].flatten() for v in values]).abs()
        change = torch.cat([v["change"].flatten() for v in values])
        full = torch.cat([v["influence"][:, real].flatten() for v in values])
        return float(self.rule.excess(change, full, self._risk0))

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        if self._risk0 is not None:
            state["replay.risk0"] = self._risk0
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "replay.risk0"})
        self._risk0 = state.get("replay.risk0")
