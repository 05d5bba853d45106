"""Probe-free discovery (``ntpflow discover RUN --site K:I``): the directions whose mismatch each component removed
most, from the influence matrices of an exact-account replay (``attribute --readout N --matrices``).

For a component c at a site, the generalized eigenproblem M_c v = λ S_0 v (symmetric-definite once S_0 is restricted
to its active subspace) gives directions v whose ratio λ = vᵀ M_c v / vᵀ S_0 v is stationary: λ is the fraction of
the direction's initial mismatch R_H(θ_0; v) that component c removed (1 = all of it; the components' λ on one
direction add up to the full's, ≈ 1). The top directions are those with the largest λ.

**Regularisation.** S_0 = U Λ Uᵀ is restricted to its active subspace, the eigenvectors with λ_j > ``rcond`` · λ_max
(default 1e-4: matrices from a float32 run carry a relative rounding of ~1e-7 of their scale, which a whitening by
Λ^{-1/2} amplifies by 1/λ_j; below 1e-4 · λ_max that noise would reach ~1e-3 of λ). With W = U_a Λ_a^{-1/2} the
problem is the ordinary one of Wᵀ M_c W = Q diag(λ) Qᵀ and v_j = W q_j (vᵀ S_0 v = 1), reported at unit norm.
Every direction lies in the active subspace. The ``share`` of direction j is λ_j |S_0 v_j|² / tr(U_aᵀ M_c U_a):
the shares add up to 1 and split what the component removed in the active subspace summed over any orthonormal basis.

**Comparison with known features.** The cosine of each direction with each ground-truth feature's ridge probe
direction (the run's final probes) at the site, and the overlap of the top-m directions' span with the features'
span, ‖P_F Q_m‖²_F / min(m, f) ∈ [0, 1] (the mean squared cosine of the principal angles). The null: the same overlap
(and the largest |cosine|) for random m-dimensional subspaces (directions) drawn as the eigenvectors of a component
with no preferred direction would be: v = W q with q uniformly random in the whitened coordinates (W = U_a Λ_a^{-1/2},
so directions of small initial mismatch are as over-represented as in the real eigenvectors), from a seeded
generator; reported as the null's mean, its 95 % quantile and the share of draws at least as large. The full
influence is its own control: M_full ≈ S_0 (all λ ≈ 1), so its directions are arbitrary, a draw of that null.

**Small active subspaces.** A p-value is marked not informative when the null leaves no room for a small one: its
``p_floor``, the p that the best value attainable in the active subspace would get against the same draws (the
overlap of the m-span closest to the features' span; the |cos| of the direction closest to a feature), is at least
``ALPHA``. That is always so when a ≤ m (every draw, like the observed span, is then the whole active subspace) and
when the features span the active subspace (every overlap is 1). Shares are marked not informative when a ≤ m: the
top directions are then all a active ones, and their shares add up to 1 by construction. Both are, where the
component moved nothing at the site (all λ = 0, as pre-cached where it is structurally absent): its directions are
arbitrary.
"""

from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path

import torch

from ntpflow.files import atomic_write, write_json
from ntpflow.model.sites import Site
from ntpflow.replay.from_account import account_matrices
from ntpflow.replay.matrices import COMPONENTS, Matrices, load_matrices
from ntpflow.runs.account import read_account
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run

MISMATCH_NAMES = ("paper", "centred")
ALPHA = 0.05
"""A p-value is informative when the best value attainable in the active subspace would have p < ALPHA."""


def generalized_eig(M: torch.Tensor, S0: torch.Tensor, rcond: float = 1e-4) -> dict:
    """M v = λ S_0 v on S_0's active subspace (eigenvalues > ``rcond`` · max), M and S_0 [d, d] symmetric, S_0 ≥ 0.

    Returns {values [a] descending, vectors [a, d] unit norm (sign: largest entry positive), shares [a],
    active a, trace_active tr(U_aᵀ M U_a), whitening W = U_a Λ_a^{-1/2} [d, a]}."""
    lam0, U = torch.linalg.eigh(S0)
    if lam0[-1] <= 0:
        raise ValueError("S_0 is zero at this site: there is no initial mismatch to split")
    keep = lam0 > rcond * lam0[-1]
    Ua, la = U[:, keep], lam0[keep]
    W = Ua / la.sqrt()
    A = W.T @ M @ W
    vals, Q = torch.linalg.eigh((A + A.T) / 2)
    vals, Q = vals.flip(0), Q.flip(1)
    V = W @ Q  # [d, a], S_0-orthonormal
    images = (la[:, None] * Q.pow(2)).sum(0)  # |S_0 v_j|² = Σ_k λ_k q_jk²
    trace_active = torch.trace(Ua.T @ M @ Ua)
    vectors = (V / V.norm(dim=0)).T
    sign = torch.sign(vectors.gather(1, vectors.abs().argmax(1, keepdim=True)))
    shares = vals * images / trace_active if trace_active != 0 else torch.zeros_like(vals)  # c moved nothing here
    return {"values": vals, "vectors": vectors * sign, "shares": shares,
            "active": int(keep.sum()), "trace_active": trace_active.item(), "whitening": W}


def _span(x: torch.Tensor, tol: float = 1e-8) -> torch.Tensor:
    """An orthonormal basis [d, r] of the columns of ``x`` [d, k] (rank-revealing: singular values > tol · max)."""
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    return u[:, s > tol * s[0]]


def overlap(Q: torch.Tensor, F: torch.Tensor) -> float:
    """‖Fᵀ Q‖²_F / min(m, f) for orthonormal bases Q [d, m] and F [d, f]: 1 when one span contains the other."""
    return ((F.T @ Q).pow(2).sum() / min(Q.shape[1], F.shape[1])).item()


def _null(W: torch.Tensor, F: torch.Tensor, feats: torch.Tensor, m: int, draws: int, seed: int) -> tuple:
    """Overlaps [draws] with F of span(W Z), Z [a, m] standard normal (W [d, a] the whitening: the span of m
    generalized eigenvectors of an isotropic component), and the largest |cos| [draws] of the direction W z with the
    features ``feats`` [f, d] (unit rows)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(draws, W.shape[1], m, generator=g, dtype=W.dtype)
    Qs = torch.linalg.qr(W @ z).Q  # [draws, d, m]
    ov = (F.T @ Qs).pow(2).sum((1, 2)) / min(m, F.shape[1])
    dirs = Qs[:, :, 0]  # the first column of each: a uniform direction
    cos = (dirs @ feats.T).abs().amax(1)
    return ov, cos


def best_overlap(basis: torch.Tensor, F: torch.Tensor, m: int) -> float:
    """The largest overlap with F [d, f] of any m-dimensional span inside span(``basis``) [d, a] (orthonormal): the
    top m squared cosines of the principal angles between the two, over min(m, f)."""
    return (torch.linalg.svdvals(F.T @ basis)[:m].pow(2).sum() / min(m, F.shape[1])).item()


def _summary(x: torch.Tensor, observed: float, attainable: float) -> dict:
    """The null draws ``x`` against ``observed``; ``p_floor``: the p of ``attainable``, the largest value possible
    (informative: p_floor < ALPHA, some observation could have been significant)."""
    def p(v: float) -> float:
        return ((x >= v).sum().item() + 1) / (len(x) + 1)

    floor = p(attainable - 1e-9)  # draws equal to the attainable maximum up to rounding
    return {"mean": x.mean().item(), "q95": torch.quantile(x, 0.95).item(), "p_at_least_observed": p(observed),
            "draws": len(x), "attainable": attainable, "p_floor": floor, "informative": floor < ALPHA}


def discover(run_dir: str | Path, site: Site, *, attribution_dir: str | Path | None = None,
             out_dir: str | Path | None = None, top: int = 3, null_draws: int = 1000, seed: int = 0,
             rcond: float = 1e-4, features: Sequence[str] | None = None) -> Path:
    """Find each component's top directions at ``site`` and compare them with the run's final probe directions
    (all of them, or those matching one of the shell patterns ``features``, e.g. ``sq_[C-F][3-6]``); write
    ``discover.json`` and ``discover.md`` to ``out_dir`` (default ATTRIBUTION_DIR/discover/K_I) and return it. The
    matrices are the attribution's (``attribute --matrices``), or, for a run trained with the account and no such
    attribution, its account's (``ntpflow.replay.from_account``). Bad
    input (no matrices, a site they lack, top < 1, null_draws < 1, a pattern no feature matches) raises ValueError
    before anything is written."""
    run = Run.open(run_dir)
    folder = run.attribution(attribution_dir)
    kept = None if attribution_dir is not None or folder.matrices.exists() else read_account(run)
    if kept is not None:  # a run trained with the account: its matrices, without attribute --matrices
        mats = Matrices(run.account.dir, account_matrices(kept),
                        {"sites": [f"{s.layer}:{s.pos}" for s in kept.sites], "config_hash": kept.spec["config_hash"],
                         "readout": kept.spec["readout"], "optimizer": kept.meta["own"]})
    else:
        mats = load_matrices(folder.dir)
    mats.check_site(site)
    if mats.meta.get("config_hash") != run.cfg.hash():
        raise ValueError(f"the matrices in {folder.dir} come from another run than {run.dir}")
    if top < 1 or null_draws < 1 or not 0 < rcond < 1:
        raise ValueError(f"discover needs top ≥ 1, null draws ≥ 1 and 0 < rcond < 1 (got {top}, {null_draws}, {rcond})")
    probes = load_or_probe(run, "final")
    names = list(probes.feature_names)
    if features is not None:
        missing = [f for f in features if not any(fnmatchcase(n, f) for n in names)]
        if missing:
            raise ValueError(f"no feature of {run.dir} matches {', '.join(missing)} (features: {', '.join(names)})")
        names = [n for n in names if any(fnmatchcase(n, f) for f in features)]
    feats = torch.stack([probes.direction(site.layer, site.pos, n) for n in names]).to(torch.float64)
    feats = feats / feats.norm(dim=1, keepdim=True).clamp_min(1e-300)
    F = _span(feats.T)
    report = {"run": str(run.dir), "site": [site.layer, site.pos], "attribution": str(folder.dir),
              "readout": mats.meta.get("readout"), "steps": mats.meta.get("steps"), "rcond": rcond, "top": top,
              "features": names, "null": {"draws": null_draws, "seed": seed}, "mismatches": []}
    for mismatch in MISMATCH_NAMES:
        S0 = mats.S0(site, mismatch)
        M = {c: mats.M(site, mismatch, c) for c in COMPONENTS}
        entry = {"mismatch": mismatch, "components": []}
        for c in COMPONENTS:
            eig = generalized_eig(M[c], S0, rcond)
            m = min(top, eig["active"])
            ov_null, cos_null = _null(eig["whitening"], F, feats, m, null_draws, seed)
            basis = _span(eig["whitening"])  # the active subspace, orthonormal
            moved = bool(eig["values"].abs().max() > 0)  # False: M_c is 0 there (e.g. pre-cached where absent)
            vecs = eig["vectors"][:m]
            observed = overlap(_span(vecs.T), F)
            null = _summary(ov_null, observed, best_overlap(basis, F, m))
            dirs = []
            for j, v in enumerate(vecs):
                cos = feats @ v
                ratios = {c2: ((v @ M[c2] @ v) / (v @ S0 @ v)).item() for c2 in COMPONENTS}
                dirs.append({"rank": j + 1, "eigenvalue": eig["values"][j].item(), "share": eig["shares"][j].item(),
                             "R0": (v @ S0 @ v).item(), "ratios": ratios,
                             "cosines": dict(zip(names, cos.tolist())),
                             "best_feature": names[int(cos.abs().argmax())], "best_abs_cos": cos.abs().max().item(),
                             "vector": v.tolist()})
            entry["components"].append({
                "component": c, "active": eig["active"], "d": len(S0), "trace_active": eig["trace_active"],
                "directions": dirs,
                "overlap": {"m": m, "observed": observed, "null": null},
                "abs_cos_null": _summary(cos_null, max(d["best_abs_cos"] for d in dirs),
                                         (feats @ basis).norm(dim=1).max().item()),
                "p_informative": null["informative"] and moved, "shares_informative": eig["active"] > m and moved})
        report["mismatches"].append(entry)
    out = Path(out_dir) if out_dir is not None else folder.discoveries / f"{site.layer}_{site.pos}"
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "discover.json", report)
    atomic_write(out / "discover.md", markdown(report))
    return out


def _ni(informative: bool | None) -> str:
    """The mark of a value that is not informative (`` (n.i.)``); none for reports written before the flag."""
    return " (n.i.)" if informative is False else ""


def markdown(report: dict) -> str:
    """The short markdown of a :func:`discover` report."""
    k, i = report["site"]
    lines = [f"# discover {report['run']} at site {k}:{i}", "",
             f"Influence matrices from `{report['attribution']}` (readout {report['readout']}, {report['steps']} "
             f"steps). λ = vᵀM_c v / vᵀS_0 v: the fraction of direction v's initial mismatch that the component "
             f"removed; share: of the component's total on the active subspace (rcond {report['rcond']:g}). Overlap "
             f"of the top-{report['top']} span with the features' span ({', '.join(report['features'])}) against "
             f"{report['null']['draws']} random spans W·Z of the whitened active dimensions, as an isotropic "
             f"component's eigenvectors would be (seed {report['null']['seed']}; the full row, all λ ≈ 1, is a draw "
             f"of it).",
             ""]
    for entry in report["mismatches"]:
        lines += [f"## {entry['mismatch']} mismatch", "",
                  "| component | active / d | λ (top) | share (top) | best feature (abs cos) of the top direction | "
                  "overlap | null mean | null q95 | p |", "|---|---|---|---|---|---:|---:|---:|---:|"]
        for comp in entry["components"]:
            dirs, ov = comp["directions"], comp["overlap"]
            lines.append(f"| {comp['component']} | {comp['active']} / {comp['d']} | "
                         f"{', '.join(format(d['eigenvalue'], '.3g') for d in dirs)} | "
                         f"{', '.join(format(d['share'], '.2f') for d in dirs)}{_ni(comp.get('shares_informative'))} | "
                         f"{dirs[0]['best_feature']} ({dirs[0]['best_abs_cos']:.2f}) | {ov['observed']:.3f} | "
                         f"{ov['null']['mean']:.3f} | {ov['null']['q95']:.3f} | {ov['null']['p_at_least_observed']:.3f}"
                         f"{_ni(comp.get('p_informative'))} |")
        lines.append("")
        if any(_ni(c.get("shares_informative")) or _ni(c.get("p_informative")) for c in entry["components"]):
            lines += [f"n.i.: not informative. p: no span of the active subspace could reach p < {ALPHA:g} against "
                      "this null (p_floor in discover.json), as when the active dimensions are at most top (every "
                      "draw is then the whole active subspace, like the observed span) or the features span them "
                      "all. Shares: the top directions are all the active ones, so their shares add up to 1 by "
                      "construction. Both, where the component moved nothing here (λ all 0: its directions are "
                      "arbitrary).", ""]
    return "\n".join(lines)
