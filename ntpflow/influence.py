"""Per-step influence of each gradient component on probed features (paper Def. 3.2–3.3, Sec. 3.4).

A feature is a probe direction w at a site ⟨k, i⟩. Its mismatch on a batch is

    R = mean_b (⟨w, r^k_i(θ)⟩ − ⟨w, r^k_i(θ*)⟩)²

with θ* the final model and r(θ) from the ordinary (non-myopic) forward, even in a myopic run. Next to this
``paper`` mismatch the tracker integrates the **centred** mismatch

    R_c = var_b (⟨w, r^k_i(θ)⟩ − ⟨w, r^k_i(θ*)⟩) = R − (mean_b (⟨w, r(θ)⟩ − ⟨w, r(θ*)⟩))²

which drops the offset of the mean projection and measures only how well the feature *varies* like the final
one (its gradient has the per-example cotangent 2(d_b − d̄)/n, so it comes from the same passes). The influence of a
component c at a step is ``∇θR · Δ_c``, where Δ_c is that component's share of the parameter update *as it is
subtracted* (θ ← θ − Σ_c Δ_c). **Positive influence means the component moved the feature toward its final value.**

- SGD variant: Δ_c = lr · g_c.
- Adam variant (reference): one first moment per site and component, the optimizer's second moment shared, so
  Δ_direct + Δ_pre_cached + Δ_shared equals the real Adam step.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attribution import SitePasses, flat_grads
from .model import GPT
from .sites import Site

COMPONENTS = ("direct", "pre_cached", "shared", "full")
MISMATCHES = ("paper", "centred")  # R = mean_b d_b², and R_c = mean_b (d_b − d̄)²


def mismatch_value(d: torch.Tensor, mismatch: str) -> torch.Tensor:
    """R (``"paper"``: mean_b d_b²) or R_c (``"centred"``: mean_b (d_b − d̄)²) of projection differences d [batch]."""
    return d.pow(2).mean() if mismatch == "paper" else (d - d.mean()).pow(2).mean()


@dataclass(frozen=True)
class Probe:
    """A feature direction ``w`` [d_model] read at ``site``; ``name`` labels the feature."""

    site: Site
    name: str
    w: torch.Tensor


def _check_optimizer(opt: torch.optim.Optimizer) -> tuple[str, dict]:
    if len(opt.param_groups) != 1:
        raise ValueError("influence tracking needs an optimizer with exactly one parameter group")
    g = opt.param_groups[0]
    if g.get("weight_decay", 0) != 0:
        raise ValueError("influence tracking needs weight_decay=0 (the component steps would not add up)")
    if g.get("maximize", False):
        raise ValueError("influence tracking needs maximize=False (a maximizing optimizer flips every sign)")
    if isinstance(opt, torch.optim.Adam) and not g.get("amsgrad", False):
        return "adam", g
    if type(opt) is torch.optim.SGD and g.get("momentum", 0) == 0 and not g.get("nesterov", False):
        return "sgd", g
    raise ValueError(f"influence tracking supports Adam and plain SGD, not {type(opt).__name__} with these options")


class InfluenceTracker:
    """Accumulates, before every optimizer step, the influence of each component on each probe.

    Call ``rows = tracker.track(model, opt, tokens, loss_mask, feature_types)`` *before* ``opt.step()``. It does
    not change gradients, optimizer state or any RNG. Rows are tidy dicts:
    ``{step, layer, pos, feature, feature_type, mismatch, component, optimizer, value}``; ``feature_type`` is -1
    for the whole batch, else the type whose rows the risk was restricted to (empty subsets are skipped);
    ``mismatch`` is ``"paper"`` (R) or ``"centred"`` (R_c, the batch variance of the projection difference);
    ``component="risk"`` rows hold R or R_c itself (``optimizer="none"``).
    """

    def __init__(self, final_model: GPT, probes: Sequence[Probe]):
        self.final_model = final_model.eval()
        self.probes = list(probes)
        self.sites = sorted({p.site for p in self.probes})
        for s in self.sites:
            s.check(final_model.cfg.n_layer, final_model.cfg.n_ctx)
        d = final_model.cfg.d_model
        for p in self.probes:
            if p.w.shape != (d,):
                raise ValueError(f"probe {p.name} at {p.site} has shape {tuple(p.w.shape)}, expected ({d},)")
        self.moments: dict[str, torch.Tensor] = {}  # "full" and "{layer}:{pos}:{component}" first moments
        self.step = 0
        # a site with more risks than this uses directional derivatives (SitePasses.jvp) instead of one VJP per
        # risk; None: twice the number of update directions (where the two cost about the same on CPU)
        self.jvp_min_risks: int | None = None

    # ---- state for resuming ----
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state for resuming: the first moments and the step."""
        return {**{f"m.{k}": v for k, v in self.moments.items()}, "step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.step = int(state["step"])
        self.moments = {k[2:]: v for k, v in state.items() if k.startswith("m.")}

    # ---- one step ----
    def risk_cotangents(self, resid: list[torch.Tensor], frozen: list[torch.Tensor],
                        feature_types: dict[str, torch.Tensor] | None):
        """For every probe, type subset and mismatch: (probe, type, mismatch, R, cotangent [batch, d_model] of R at
        the site). The centred cotangent 2(d_b − d̄)/n is the exact gradient of R_c, since Σ_b (d_b − d̄) = 0.

        resid, frozen: lists of [batch, pos, d_model] for θ and θ*; feature_types: {probe name: int [batch, pos]}.
        """
        out = []
        for p in self.probes:
            w = p.w.to(resid[0])
            diff = (resid[p.site.layer][:, p.site.pos] - frozen[p.site.layer][:, p.site.pos]) @ w  # [batch]
            subsets = [(-1, torch.ones_like(diff, dtype=torch.bool))]
            types = None if feature_types is None else feature_types.get(p.name)
            if types is not None:
                ft = types[:, p.site.pos]
                subsets += [(int(t), ft == t) for t in torch.unique(ft).tolist()]
            for t, rows in subsets:
                n = rows.sum()
                if n == 0:
                    continue
                d = torch.where(rows, diff, 0.0)
                dc = torch.where(rows, diff - d.sum() / n, 0.0)
                for mismatch, e in zip(MISMATCHES, (d, dc)):
                    out.append((p, t, mismatch, (e.pow(2).sum() / n).item(), (2 * e / n)[:, None] * w[None, :]))
        return out

    def track(self, model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor,
              loss_mask: torch.Tensor | None = None, feature_types: dict[str, torch.Tensor] | None = None
              ) -> list[dict]:
        """Influence rows for this step (see class docstring). ``feature_types`` maps a probe name to int
        [batch, pos] type labels (e.g. Othello square types); probes without an entry get whole-batch risks.

        How: per site, one prefix graph serves the site's decomposition VJPs and the VJPs ∇θR of its risks (in a
        non-myopic model; a myopic one also builds the ordinary graph). A site with many risks (more than
        ``jvp_min_risks``) instead takes directional derivatives of its residual along the update directions. The influences are then one product
        ∇θR · [g_direct, g_pre, g_full, Adam Δ_direct, Adam Δ_pre, Adam Δ_full]ᵀ per site; the shared parts follow
        as full − direct − pre. No delta vector is materialised per component.
        """
        kind, group = _check_optimizer(opt)
        params = list(model.parameters())
        passes = SitePasses(model, tokens, self.sites, loss_mask)  # forward + the two cotangent passes
        with torch.no_grad():
            _, frozen = self.final_model(tokens, return_resid=True, myopic="none")
            resid = passes.resid if model.myopic == "none" else model(tokens, return_resid=True, myopic="none")[1]
        risks = self.risk_cotangents(resid, frozen, feature_types)
        g_full = passes.full
        lr = group["lr"]
        # rows of D: g_direct, g_pre, g_full (SGD: Δ = lr·g), then Adam Δ_direct, Δ_pre, Δ_full (per-site rows 0, 1,
        # 3, 4 are rewritten for every site)
        D = g_full.new_empty((6 if kind == "adam" else 3, passes.n_params))
        D[2] = g_full
        if kind == "adam":
            scale, D[5] = self._adam_scale(opt, group, params, g_full)
        rows = [self._row(p, t, m, "risk", "none", risk) for p, t, m, risk, _ in risks]
        for site in self.sites:  # one site at a time bounds memory
            idx = [n for n, (p, *_) in enumerate(risks) if p.site == site]
            cots = torch.stack([risks[n][4] for n in idx]) if idx else None  # [n_risks, batch, d_model]
            threshold = 2 * len(D) if self.jvp_min_risks is None else self.jvp_min_risks
            by_jvp = len(idx) > threshold
            _, grads_r = passes.run(site, out=D[0:2], extra=None if by_jvp else cots)
            if kind == "adam":
                for row, comp in ((0, "direct"), (1, "pre_cached")):
                    torch.mul(scale, self._moment(f"{site.layer}:{site.pos}:{comp}", D[row], group), out=D[row + 3])
            if not idx:
                continue
            if by_jvp:  # ∇R·δ = e·(Jδ): len(D) passes instead of one per risk
                grads_r, D_site = cots.flatten(1), passes.jvp(site, D).flatten(1)
            else:
                D_site = D
            values = (grads_r @ D_site.T).tolist()  # [n_risks, 3 or 6]: ∇R · (g_dir, g_pre, g_full[, Adam deltas])
            for n, v in zip(idx, values):
                p, t, m = risks[n][:3]
                dv, pv, fv = lr * v[0], lr * v[1], lr * v[2]
                rows += [self._row(p, t, m, c, "sgd", x) for c, x in zip(COMPONENTS, (dv, pv, fv - dv - pv, fv))]
                if kind == "adam":
                    rows += [self._row(p, t, m, c, "adam", x)
                             for c, x in zip(COMPONENTS, (v[3], v[4], v[5] - v[3] - v[4], v[5]))]
        self.step += 1
        return rows

    def _moment(self, key: str, g: torch.Tensor, group: dict) -> torch.Tensor:
        """Update and return the first moment ``key``: m ← β1·m + (1−β1)·g (zero-initialised)."""
        beta1 = group["betas"][0]
        m = self.moments.get(key)
        if m is None:
            self.moments[key] = m = (1 - beta1) * g
        else:
            m.mul_(beta1).add_((1 - beta1) * g)  # in place, same rounding as β1·m + (1−β1)·g
        return m

    def _adam_scale(self, opt, group, params, g_full):
        """(per-parameter step scale lr/(1−β1^t)/(sqrt(v̂)+eps) [n_params], the real Adam step [n_params]).

        v is the optimizer's second moment updated with this step's gradient, shared by every component.
        """
        beta1, beta2 = group["betas"]
        states = [opt.state.get(p, {}) for p in params]
        t = int(states[0]["step"]) + 1 if states[0] else 1
        v_prev = flat_grads([s.get("exp_avg_sq") for s in states], params)
        v = beta2 * v_prev + (1 - beta2) * g_full * g_full
        scale = group["lr"] / (1 - beta1**t) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
        return scale, scale * self._moment("full", g_full, group)

    def _row(self, p: Probe, t: int, mismatch: str, component: str, optimizer: str, value: float) -> dict:
        return {"step": self.step, "layer": p.site.layer, "pos": p.site.pos, "feature": p.name,
                "feature_type": t, "mismatch": mismatch, "component": component, "optimizer": optimizer,
                "value": value}
