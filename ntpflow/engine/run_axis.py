"""Influence tracking over a run axis: the tracked members of a run group in one pass per step.

``InfluenceTracker.influences`` (the whole tensor work of a tracked step) runs under ``torch.func.vmap`` over the
members, with each member's weights, Adam second moment (under Adam), first moments or momentum buffers, batch, θ*
projections and probe directions as the batched inputs. The ordinary backward is the ``torch.func`` one
(``SitePasses(functional=True)``), since ``torch.autograd`` does not see through vmap. One step therefore launches
each kernel once for all R members, as the group's training step does (``ntpflow.runs.group``), instead of once per
member.

Each member keeps its own ``InfluenceTracker`` for everything that is not tensor work (probes, sites, the θ*
projections of its dataset, resume state, rows); its first moments become views into the stacked
``[R, n_sites, 2, n_params]`` and ``[R, n_params]`` moments, so its ``state_dict`` is unchanged. The values agree with
R separate trackers to rounding (batched kernels round differently from unbatched ones; ``tests/test_run_axis.py``
bounds the difference in float64), and a replay through this path is deterministic, so it resumes to the same bits.

The exact reading runs the members' accounts (``ntpflow.engine.replay_account.ReplayAccount``) the same way:
``ExactAccount._integral`` under vmap, each member judging each rule by its own risks.
"""

import math
import warnings
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.func import functional_call, vmap

from ntpflow.engine.decomposition import SitePasses
from ntpflow.engine.exact import ExactAccount
from ntpflow.engine.forward_mode import Primals
from ntpflow.engine.influence import (
    AdamStep,
    InfluenceTracker,
    MomentumStep,
    _check_optimizer,
    adam_second_moment,
)
from ntpflow.model.gpt import GPT
from ntpflow.model.stack import RunStack


class _Bound(nn.Module):
    """``forward(fn, *args) = fn(model, *args)``: lets ``functional_call`` swap the parameters of ``model`` for any
    computation on it, not only its forward."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, fn, *args):
        return fn(self.model, *args)


class RunAxisTracker:
    """Tracks members of one run group together (same sites, features and options; one step for all).

    ``rows = tracker.track(stack, group_opt, members, tokens, loss_mask, example_ids)`` before the group's step:
    ``members`` [R] are the tracked members' indices in the group's ``RunStack``, the batches tokens, loss_mask
    [R, batch, pos] and example_ids [R, batch] are theirs; returns each member's rows, as its own
    ``InfluenceTracker.track`` would (to rounding). Only whole-batch risks (no feature types). For the exact reading
    the members are their accounts (``ReplayAccount``, each on its own readout set of one size; their rows go to their
    own ``on_chunk``, and ``track`` returns empty lists): a step is integrated for all members at once, and again at
    the next rule (more points, then the composite rules) while some member's risks miss their tolerance; each member
    keeps the rule its own account would settle at. Any optimizer a group trains with: Adam, SGD with or without
    momentum, on a schedule or not.
    """

    def __init__(self, trackers: Sequence[InfluenceTracker]):
        self.trackers = list(trackers)
        first = self.trackers[0]
        key = [(p.site, p.name) for p in first.probes]
        for t in self.trackers[1:]:
            if ([(p.site, p.name) for p in t.probes] != key or (type(t), t.sites, t.midpoint, t.sgd_rows, t.bucket_width)
                    != (type(first), first.sites, first.midpoint, first.sgd_rows, first.bucket_width)
                    or _readout_key(t) != _readout_key(first)):
                raise ValueError("the members tracked over a run axis need the same sites, features and options")
        if first.final_model is None and not isinstance(first, ExactAccount):
            raise ValueError("the members tracked over a run axis need their final models")
        if first.readout is not None:
            raise ValueError("the exact reading over a run axis takes each member's account "
                             "(ntpflow.engine.replay_account.ReplayAccount), not a tracker's use_readout")
        self._bound = _Bound(GPT(first.cfg).to("meta"))  # the architecture; weights come per call
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # see _moments
        self._views: list = []
        self._directions = torch.stack([t.directions for t in self.trackers])  # [R, n_probes, d_model]

    def track(self, stack: RunStack, group_opt: torch.optim.Optimizer, members: Sequence[int], tokens: torch.Tensor,
              loss_mask: torch.Tensor, example_ids: torch.Tensor) -> list[list[dict]]:
        """Each tracked member's rows for this step (see the class docstring)."""
        kind, group = _check_optimizer(group_opt)
        first = self.trackers[0]
        if len({t.step for t in self.trackers}) > 1:
            raise RuntimeError("the members tracked over a run axis must be at the same step")
        idx = torch.tensor(list(members), device=tokens.device)
        params = {n: s.detach()[idx] for n, s in zip(stack.names, stack.stacked)}
        n_params = sum(s[0].numel() for s in stack.stacked)
        empty = stack.stacked[0].new_zeros((len(idx), 0))  # a stand-in, so every kind takes the same vmapped arguments
        if kind == "adam":
            v_prev, t = adam_second_moment(group_opt, list(stack.stacked), idx)  # [R, n_params]
        else:  # SGD keeps no second moment
            v_prev, t = empty, 0
        if kind == "sgd":  # and plain SGD no first moments either: the trackers keep none, as alone
            m_full, m_sites = empty, empty[:, None, None].expand(-1, len(first.sites), 2, 0)
        else:
            m_full, m_sites = self._moments(empty.new_zeros((len(idx), n_params)))
        lr, step_of = group["lr"], _step_of(kind, group, t)
        optim = (v_prev, step_of, m_full, m_sites)
        if isinstance(first, ExactAccount):
            return self._account(params, stack, tokens, loss_mask, lr, optim)
        final_proj = torch.stack([tr._cached_projections(i) for tr, i in zip(self.trackers, example_ids)])
        layout = []

        def one(params, tokens, loss_mask, final_proj, w, v_prev, m_full, m_sites):
            def on(model):
                passes = SitePasses(model, tokens, first.sites, loss_mask, functional=True)
                midpoint = ((lambda step: self._midpoint(model, step, passes.primals.tokens)) if first.midpoint
                            else None)
                values, lay = first.influences(passes, final_proj, w, None, lr, step_of(v_prev, m_full, m_sites),
                                               midpoint)
                layout.append(lay)
                return values

            return self._call(params, stack, on)

        values = _vmapped(one)(params, tokens, loss_mask, final_proj, self._directions, v_prev, m_full, m_sites)
        out = []
        for tr, v in zip(self.trackers, values.tolist()):  # one device sync for all members
            out.append(tr.rows(v, layout[0], lr))
            tr.step += 1
        return out

    def _account(self, params: dict, stack: RunStack, tokens: torch.Tensor, loss_mask: torch.Tensor, lr: float,
                 optim: tuple) -> list[list[dict]]:
        """Each member's account of this step (``ExactAccount._integral`` under vmap; members' rows come through
        their own ``on_chunk``, so the lists returned are empty): each member judges each rule by its own
        ``_excess`` and settles at the rule its lone account would."""
        accounts = cast(list[ExactAccount], self.trackers)
        first = accounts[0]
        v_prev, step_of, m_full, m_sites = optim
        ro_tokens = torch.stack([a.rule.tokens for a in accounts])  # [R, N, n_pos]
        if first._resid is None:  # θ_0 (or a resumed step) of every member: a plain forward on its readout set
            def start(params, ro_tokens):
                return self._call(params, stack, lambda m: list(
                    first._site_resid(Primals(m, ro_tokens, first.top_layer)).values()))

            resid = _vmapped(start)(params, ro_tokens)  # per site [R, N, d]
            for r, a in enumerate(accounts):
                a._resid = {s: x[r] for s, x in zip(first.sites, resid)}
        for a in accounts:
            a._begin_step(lr)
        settled: list = [None] * len(accounts)  # per member: (sink, end, level) of the rule it settled at
        previous = [math.inf] * len(accounts)
        for level, (n, pieces) in enumerate(first.rule.rules):
            def one(params, tokens, loss_mask, ro_tokens, v_prev, m_full, m_sites):
                def on(model):
                    passes = SitePasses(model, tokens, first.sites, loss_mask, functional=True)
                    sink: dict = {}
                    end = first._integral(passes, lr, step_of(v_prev, m_full, m_sites), None, n, pieces, level == 0,
                                          sink, lambda step, s: self._shifted(model, step, s, ro_tokens))
                    return [sink[s] for s in first.sites], [end[s] for s in first.sites]

                return self._call(params, stack, on)

            sinks, ends = _vmapped(one)(params, tokens, loss_mask, ro_tokens, v_prev, m_full, m_sites)
            for r, a in enumerate(accounts):
                sink = {s: {k: v[r] for k, v in acc.items()} for s, acc in zip(first.sites, sinks)}
                end = {s: e[r] for s, e in zip(first.sites, ends)}
                excess = a._excess(sink, end)
                if settled[r] is None and a.rule.settles(level, excess, previous[r]):
                    settled[r] = (sink, end, level)
                previous[r] = excess
            if all(x is not None for x in settled):
                break
        for a, (sink, end, level) in zip(accounts, settled):
            a._end_step(sink, end, level)
        return [[] for _ in accounts]

    def _call(self, params: dict, stack: RunStack, fn):
        """``fn(model)`` on the architecture with one member's ``params`` swapped in (under vmap: a batched one)."""
        return functional_call(self._bound, ({f"model.{n}": v for n, v in params.items()},
                                             {"model.groups": stack.groups}), (fn,))

    def _moments(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The members' first moments stacked, [R, n_params] and [R, n_sites, 2, n_params] (zeros before the first
        step, else stacked from the trackers, e.g. after resuming); each member's tracker then holds views of its
        rows, so that its ``state_dict`` sees the updates."""
        trackers = self.trackers
        if self._stacked is not None and self._views and all(tr._m_full is v for tr, v in zip(trackers, self._views)):
            return self._stacked
        moments = [(tr._m_full, tr._m_sites) for tr in trackers]
        present = [(full, sites) for full, sites in moments if full is not None and sites is not None]
        if all(full is None for full, _ in moments):
            m_full = like.new_zeros(like.shape)
            m_sites = like.new_zeros((len(trackers), len(trackers[0].sites), 2, like.shape[1]))
        elif len(present) == len(trackers):  # the two are set together
            m_full = torch.stack([full for full, _ in present])
            m_sites = torch.stack([sites for _, sites in present])
        else:
            raise RuntimeError("the members tracked over a run axis must resume from the same step")
        for r, tr in enumerate(trackers):
            tr._m_full, tr._m_sites = m_full[r], m_sites[r]
        self._stacked, self._views = (m_full, m_sites), [tr._m_full for tr in trackers]
        return self._stacked

    def _midpoint(self, model: GPT, step: torch.Tensor, tokens: torch.Tensor) -> Primals:
        """The cached ordinary forward at θ − step/2 (``step`` flat [n_params], the update as subtracted), on
        ``model``'s (swapped-in) parameters: as ``InfluenceTracker._midpoint_primals``, without writing weights."""
        return self._shifted(model, step, 0.5, tokens)

    def _shifted(self, model: GPT, step: torch.Tensor, s: float, tokens: torch.Tensor) -> Primals:
        """The cached ordinary forward of ``tokens`` at θ − s·step (``step`` flat [n_params], as subtracted), on
        ``model``'s (swapped-in) parameters, without writing weights."""
        named = dict(model.named_parameters())
        moved = {f"model.{n}": torch.sub(p, d.view_as(p), alpha=s)
                 for (n, p), d in zip(named.items(), step.split([p.numel() for p in named.values()]))}
        buffers = {f"model.{n}": b for n, b in model.named_buffers()}
        top = self.trackers[0].top_layer  # the members' sites are the same
        return functional_call(self._bound, (moved, buffers), (lambda m: Primals(m, tokens, top),))


def _step_of(kind: str, group: dict, t: int):
    """``(v_prev, m_full, m_sites) -> AdamStep | MomentumStep | None``: one member's step of the group's optimizer
    (``kind`` from ``_check_optimizer``, ``group`` its settings, ``t`` Adam's step number), on that member's second
    moment (Adam) and the tracker's first moments or buffers; None for plain SGD."""
    if kind == "adam":
        return lambda v_prev, m_full, m_sites: AdamStep(v_prev, t, group["betas"], group["eps"], m_full, m_sites)
    if kind == "momentum":
        return lambda v_prev, m_full, m_sites: MomentumStep(group["momentum"], m_full, m_sites)
    return lambda v_prev, m_full, m_sites: None


def _readout_key(tracker: InfluenceTracker) -> tuple | None:
    """What members tracked together must share about their readout sets: size and rule (None: no readout)."""
    ro = tracker.rule if isinstance(tracker, ExactAccount) else tracker.readout
    return None if ro is None else (len(ro.tokens), ro.levels, ro.pieces, ro.rtol, ro.floor, ro.cap, ro.stall)


def _vmapped(fn):
    """``vmap(fn)``, quiet about the CPU attention kernel that has no batching rule (vmap loops over the runs)."""
    def call(*args):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
            return vmap(fn)(*args)
    return call
