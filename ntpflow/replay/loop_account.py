"""The exact account for a training loop of one's own: ``ntpflow.Account`` (docs/balance.md#the-account-while-training-in-run).

    account = ntpflow.Account(model, opt, sites=[Site(1, 4)], readout=held_out_tokens, clip=1.0)
    for tokens, mask in batches:
        loss = account.step(tokens, mask)   # backward, clipping, the optimizer's step, and the account
        scheduler.step()
    result = account.finish({"my_feature": (Site(1, 4), w)})   # any directions, read at the end
    result.summary                                             # per direction and mismatch: totals and shares

Nothing is replayed, so the loop need not repeat itself: any data order, any scheduler. Supported: Adam, AdamW
(its weight decay is the row ``decay``, so the rows still add up to the change), SGD with or without momentum, and
gradient-norm clipping (the clip factor applies to every component). The model must be an ``ntpflow.GPT``.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import torch

from ntpflow.engine.exact import ExactAccount
from ntpflow.engine.influence import MISMATCHES, Probe
from ntpflow.model.gpt import GPT
from ntpflow.model.shapes import Mask, Tokens
from ntpflow.model.sites import Site
from ntpflow.replay.answer import shares
from ntpflow.replay.conditioning import condition, step_kappas
from ntpflow.replay.from_account import account_rows


@dataclass(frozen=True)
class AccountResult:
    """What :meth:`Account.finish` reads: ``rows`` (per chunk of steps, the schema of ``influence.parquet``: step,
    layer, pos, feature, feature_type, mismatch, component, optimizer, value, cumulative) and ``summary`` (per
    direction and mismatch: each reading's totals ``{reading}_{component}``, ``change``, ``residual``, ``R0``, the
    conditioning ``kappa_*`` and the own reading's ``shares`` of the change)."""

    rows: list[dict]
    summary: list[dict]
    own: str


class Account:
    """The exact account of a plain PyTorch loop over an ``ntpflow.GPT``.

    model: the model trained; optimizer: its optimizer (one parameter group; Adam, AdamW or SGD); sites: the
    residual sites (``Site`` or "LAYER:POS"); readout: tokens [N, T] (N ≥ 2) on which each mismatch is read;
    clip: the gradient-norm bound, or None; chunk_steps: steps summed per row (1: every step has its rows);
    sgd_rows: also keep the SGD direction's rows (the second reading)."""

    def __init__(self, model: GPT, optimizer: torch.optim.Optimizer, sites: Sequence[Site | str], readout: Tokens, *,
                 clip: float | None = None, chunk_steps: int = 1, sgd_rows: bool = True):
        sites = [s if isinstance(s, Site) else Site.parse(s) for s in sites]
        self.model = model
        self._account = ExactAccount(model, optimizer, sites, readout, chunk_steps=chunk_steps, sgd_rows=sgd_rows,
                                     clip=clip, rtol=1e-4)

    def step(self, tokens: Tokens, loss_mask: Mask | None = None) -> torch.Tensor:
        """Take the optimizer's step on ``tokens`` [batch, T] (``loss_mask`` [batch, T]: the positions whose loss
        counts) and account for it; returns the loss before the step (0-dim)."""
        return self._account.train_step(tokens, loss_mask)

    @property
    def steps(self) -> int:
        """The steps taken so far."""
        return self._account.step

    def finish(self, directions: dict[str, tuple[Site | str, torch.Tensor]]) -> AccountResult:
        """The rows and summary of ``directions`` {name: (site, w [d_model])} read with the model's current weights
        as θ* (call it after the last step). May be called again with other directions."""
        acc = self._account
        acc.end_chunk()
        if not acc.chunks:
            raise ValueError("no step was taken: nothing to account for")
        probes = []
        for name, (site, w) in directions.items():
            site = site if isinstance(site, Site) else Site.parse(site)
            if site not in acc.sites:
                raise ValueError(f"direction {name!r} is at {site}, not one of the account's sites {acc.sites}")
            probes.append(Probe(site, name, torch.as_tensor(w).reshape(-1).to(torch.float64)))
        with torch.no_grad():
            resid = self.model(acc.tokens, return_resid=True, myopic="none")[1]
        final = {s: resid[s.layer][:, s.pos].to(torch.float64) for s in acc.sites}
        rows = account_rows(acc.chunks, final, acc.own, acc.names, probes)
        return AccountResult(rows, _summary(rows, acc.own), acc.own)


def _summary(rows: list[dict], own: str) -> list[dict]:
    """Per (site, feature, mismatch): the totals of each reading, the change, residual, R0 (the first risk), κ and
    shares, from the rows."""
    entries: dict[tuple, dict] = {}
    for r in rows:
        key = (r["layer"], r["pos"], r["feature"], -1, r["mismatch"])
        e = entries.setdefault(key, {"layer": r["layer"], "pos": r["pos"], "feature": r["feature"],
                                     "mismatch": r["mismatch"]})
        if r["component"] == "risk":
            e.setdefault("R0", r["value"])
        elif r["component"] in ("change", "residual"):
            e[r["component"]] = r["cumulative"]
        else:
            e[f"{r['optimizer']}_{r['component']}"] = r["cumulative"]
    steps = step_kappas(pa.Table.from_pylist(rows))
    out = []
    for key, e in entries.items():
        e.update(condition(e, steps, key, own))
        e["shares"] = shares(e, own)
        out.append(e)
    order = {m: j for j, m in enumerate(MISMATCHES)}
    return sorted(out, key=lambda e: (e["layer"], e["pos"], e["feature"], order[e["mismatch"]]))
