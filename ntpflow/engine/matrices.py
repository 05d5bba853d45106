"""Influence matrices: every direction's influence at a site at once (the exact account's matrix form).

At a site ⟨k, i⟩ and on the readout set H (N sequences), R(w) = wᵀ S w with S = mean_b e_b e_bᵀ, e_b = r_θ(x_b) −
r_θ*(x_b) [d_model] (paper mismatch), and R_c(w) = wᵀ S_c w with e_b centred over H (covariance). Along a component's
update direction Δ_c (as subtracted, θ ← θ − Σ_c Δ_c) the path integral of S's decrease is

    M_c(step) = ∫₀¹ mean_b (ṙ_b e_bᵀ + e_b ṙ_bᵀ) ds,   ṙ_b = J(θ_t − sΔ) Δ_c  (the site's residual tangent)

evaluated at the same Gauss–Legendre points as the probe rows (``InfluenceTracker.use_readout``), so that
wᵀ M_c w is exactly the probe row of direction w (sign: positive = moved toward the final value). Summed over
training, M_full = Σ_c M_c splits S_0 − S_T = S_0 (θ_T = θ*) up to the quadrature residual.
"""

import torch

from ntpflow.engine.forward_mode import Primals
from ntpflow.model.sites import Site

MATRIX_COMPONENTS = ("direct", "pre_cached", "full")  # accumulated; shared = full − direct − pre_cached


class InfluenceMatrices:
    """The running matrices of a tracker's sites (float64, or the probes' dtype on MPS).

    ``final`` {site: θ*'s residual [N, d_model]} on the readout set; per site the running sums ``total``
    [3 (direct, pre_cached, full), 2 (paper, centred), d, d] and ``S0`` [2, d, d] (set at the first step)."""

    def __init__(self, sites: list[Site], final_resid: list[torch.Tensor], dtype: torch.dtype):
        """final_resid: θ*'s ordinary-forward residuals, per layer [N, pos, d_model] (``GPT.forward``)."""
        self.sites, self.dtype = list(sites), dtype
        self.final = {s: final_resid[s.layer][:, s.pos].to(dtype) for s in self.sites}
        d = final_resid[0].shape[-1]
        self.total = {s: final_resid[0].new_zeros((3, 2, d, d), dtype=dtype) for s in self.sites}
        self.S0: dict[Site, torch.Tensor] | None = None

    def errors(self, resid: torch.Tensor, site: Site) -> torch.Tensor:
        """e_b = r_θ − r_θ* [N, d] of the residual ``resid`` [N, d] at ``site``, in the matrices' dtype."""
        return resid.to(self.dtype) - self.final[site]

    def start(self, primals: Primals) -> None:
        """S_0 and S_c,0 of every site [2, d, d] from the forward at θ_0 on the readout set."""
        self.S0 = {}
        for s in self.sites:
            e = self.errors(primals.resid[s.layer][:, s.pos], s)
            ec = e - e.mean(0)
            self.S0[s] = torch.stack([e.T @ e, ec.T @ ec]) / len(e)

    def node_terms(self, resid: torch.Tensor, site: Site, tau: torch.Tensor) -> torch.Tensor:
        """mean_b ṙ_b e_bᵀ and its centred form [c, 2, d, d] at one quadrature point: ``resid`` [N, d] the site's
        residual there, ``tau`` [c, N, d] its tangents along c directions. (The symmetric part is taken in ``add``.)"""
        e = self.errors(resid, site)
        t = tau.to(self.dtype)
        g = t.transpose(1, 2) @ e / len(e)  # [c, d, d]
        gc = g - t.mean(1)[:, :, None] * e.mean(0)[None, None, :]  # Σ_b ṙ_b (e_b − ē)ᵀ / N
        return torch.stack([g, gc], 1)

    def add(self, terms: dict[Site, torch.Tensor], scale: float) -> None:
        """Add a step's integrals {site: Σ_j ω_j node_terms [3, 2, d, d]} (direct, pre_cached, full), times
        ``scale`` (lr for SGD directions, 1 for Adam steps), symmetrised: G + Gᵀ."""
        for s, g in terms.items():
            self.total[s] += scale * (g + g.transpose(-1, -2))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The running sums ``matrices.{layer}:{pos}`` and ``matrices.S0.{layer}:{pos}`` (none before step 0)."""
        if self.S0 is None:
            return {}
        out = {f"matrices.{s.layer}:{s.pos}": self.total[s] for s in self.sites}
        return out | {f"matrices.S0.{s.layer}:{s.pos}": self.S0[s] for s in self.sites}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (an empty state: before the first step)."""
        first = f"matrices.S0.{self.sites[0].layer}:{self.sites[0].pos}"
        if first not in state:
            self.S0 = None
            for t in self.total.values():
                t.zero_()
            return
        self.S0 = {}
        for s in self.sites:
            self.total[s].copy_(state[f"matrices.{s.layer}:{s.pos}"])
            self.S0[s] = state[f"matrices.S0.{s.layer}:{s.pos}"].to(self.total[s])

    def tensors(self) -> dict[str, torch.Tensor]:
        """What ``matrices.safetensors`` holds: ``M.{layer}:{pos}.{mismatch}.{component}`` [d, d] for direct,
        pre_cached, shared (= full − direct − pre_cached) and full; ``S0.{layer}:{pos}.{mismatch}`` [d, d]; θ*'s
        residuals ``final_resid.{layer}:{pos}`` [N, d]."""
        if self.S0 is None:
            raise RuntimeError("no step was tracked: the matrices are empty")
        out = {}
        for s in self.sites:
            key = f"{s.layer}:{s.pos}"
            out[f"final_resid.{key}"] = self.final[s]
            for j, mismatch in enumerate(("paper", "centred")):
                direct, pre, full = self.total[s][:, j]
                for comp, m in zip(("direct", "pre_cached", "shared", "full"), (direct, pre, full - direct - pre, full)):
                    out[f"M.{key}.{mismatch}.{comp}"] = m
                out[f"S0.{key}.{mismatch}"] = self.S0[s][j]
        return out
