"""Influence matrices of a finished exact-account replay (``attribute --readout N --matrices``): saving them, and
reading any direction's influence afterwards without replaying again.

``ATTRIBUTION_DIR/matrices.safetensors`` (checksummed; its sidecar ``matrices.json`` holds the metadata) has, per
tracked site ``{layer}:{pos}`` and mismatch (``paper``: S = mean_b e_b e_bᵀ; ``centred``: the covariance)::

    M.{site}.{mismatch}.{component}  [d, d]  integrated over training, component in direct, pre_cached, shared, full
    S0.{site}.{mismatch}             [d, d]  S at θ_0 on the readout set (S_T = 0: θ_T is θ*)
    final_resid.{site}               [N, d]  θ*'s residuals on the readout set

For a direction w, wᵀ M_c w is the influence of component c on R(w) = wᵀ S w (positive = moved toward the final
value) and wᵀ S0 w is R_H(θ_0); Σ_c M_c = M_full = S_0 up to the quadrature residual. They are the exact account's
(``ntpflow.engine.exact.chunk_matrices``, summed over its chunks): the replay's or the one kept while training.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from ntpflow.files import load_tensors, read_json, save_tensors, sidecar
from ntpflow.model.sites import Site
from ntpflow.runs.run import AttributionDir

COMPONENTS = ("direct", "pre_cached", "shared", "full")


def save_matrices(out: Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write the matrices ``tensors`` (the layout above, ``ntpflow.replay.from_account.matrices_layout``) to
    ``out``'s ``matrices.safetensors`` (atomic, sidecar last) with ``meta``, its sites and components."""
    path = AttributionDir(Path(out)).matrices
    sites = list(dict.fromkeys(k.split(".")[1] for k in tensors if k.startswith("S0.")))
    comps = [c for c in (*COMPONENTS, "decay") if f"M.{sites[0]}.paper.{c}" in tensors]
    save_tensors(path, {k: v.cpu() for k, v in tensors.items()},
                 {**meta, "sites": sites, "components": comps, "sign": "positive = moved toward the final value"})
    return path


@dataclass(frozen=True)
class Matrices:
    """The influence matrices of one attribution folder (float64 on the CPU); ``meta`` from the sidecar."""

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict

    @property
    def sites(self) -> list[Site]:
        return [Site.parse(s) for s in self.meta["sites"]]

    def check_site(self, site: Site) -> None:
        """Raise ValueError (one line) unless the matrices have ``site``."""
        if f"S0.{site.layer}:{site.pos}.paper" not in self.tensors:
            raise ValueError(f"the matrices in {self.path} have no site {site.layer}:{site.pos} "
                             f"(sites: {', '.join(self.meta['sites'])})")

    def M(self, site: Site, mismatch: str, component: str) -> torch.Tensor:
        """M_c [d, d] of ``component`` at ``site`` for ``mismatch`` ("paper" or "centred")."""
        self.check_site(site)
        return self.tensors[f"M.{site.layer}:{site.pos}.{mismatch}.{component}"]

    def S0(self, site: Site, mismatch: str) -> torch.Tensor:
        """S at θ_0 [d, d] on the readout set."""
        self.check_site(site)
        return self.tensors[f"S0.{site.layer}:{site.pos}.{mismatch}"]

    def final_resid(self, site: Site) -> torch.Tensor:
        """θ*'s residuals on the readout set [N, d]."""
        self.check_site(site)
        return self.tensors[f"final_resid.{site.layer}:{site.pos}"]


def load_matrices(attribution_dir: str | Path) -> Matrices:
    """The influence matrices of the attribution folder ``attribution_dir`` (ValueError if it has none)."""
    path = AttributionDir(Path(attribution_dir)).matrices
    if not path.exists() or not sidecar(path).exists():
        raise ValueError(f"{attribution_dir} holds no influence matrices (replay the run with "
                         "attribute --readout N --matrices)")
    return Matrices(path, load_tensors(path), read_json(sidecar(path)))


def direction_influence(attribution_dir: str | Path, site: Site, w: torch.Tensor, mismatch: str = "paper"
                        ) -> dict[str, float]:
    """The influence of each component on R(w) = wᵀ S w at ``site`` (w [d_model], used as given, not normalised):
    {direct, pre_cached, shared, full: wᵀ M_c w, R0: wᵀ S_0 w, residual: wᵀ (M_full − S_0) w}. A probe direction
    gives its probe rows' totals. Reads ``matrices.safetensors``; nothing is replayed."""
    if mismatch not in ("paper", "centred"):
        raise ValueError(f"mismatch is 'paper' or 'centred', not {mismatch!r}")
    mats = load_matrices(attribution_dir)
    S0 = mats.S0(site, mismatch)
    w = torch.as_tensor(w).to(S0)
    if w.shape != (len(S0),):
        raise ValueError(f"the direction has shape {tuple(w.shape)}; the site's residual has {len(S0)} dimensions")
    out = {c: (w @ mats.M(site, mismatch, c) @ w).item() for c in COMPONENTS}
    out["R0"] = (w @ S0 @ w).item()
    out["residual"] = out["full"] - out["R0"]
    return out
