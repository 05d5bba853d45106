"""``attribute`` without a replay: the rows and matrices of a run trained with the exact account (``train
--account``), contracted with θ*'s readout residuals and the probes' directions (``ntpflow.engine.exact``).

The rows have the replay's schema with one difference of granularity: the account keeps chunks of steps (at most
``DEFAULT_CHUNKS``). A chunk's ``risk`` rows are at its first step (R_H at that step's start, as the replay's), its
influence, ``change`` and ``residual`` rows at its last step, their values the sums over the chunk's steps and their
cumulative values the replay's at that step; ``kappa_steps`` is then read over chunks, a lower bound of the per-step
figure (one step a chunk gives the replay's rows).
"""

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ntpflow.engine.exact import chunk_matrices, chunk_values
from ntpflow.engine.influence import MISMATCHES, Probe
from ntpflow.model.sites import Site
from ntpflow.replay.matrices import save_matrices
from ntpflow.runs.account import KeptAccount

COMPONENTS = ("direct", "pre_cached", "shared", "full")


def account_rows(chunks: Iterable[tuple[int, dict[str, torch.Tensor]]], final: dict[Site, torch.Tensor], own: str,
                 names: Sequence[tuple[str, str]], probes: Sequence[Probe],
                 types: dict[str, torch.Tensor] | None = None) -> list[dict]:
    """Every probe's rows from an account's ``chunks`` [(first step, tensors)], θ*'s readout residuals ``final``
    {site: [N, d]}, its own reading's name and its accumulated rows ``names`` [(kind, component)]: chunk by chunk, in
    the schema of ``InfluenceTracker`` rows with ``cumulative``: feature_type -1 (the whole readout), and for a probe
    whose feature has kept type labels ``types`` {feature: [N, pos]} one set per type present at its position."""
    types = types or {}
    by_site: dict[tuple[Site, int], list[Probe]] = defaultdict(list)
    for p in probes:
        present = [] if p.name not in types else torch.unique(types[p.name][:, p.site.pos]).tolist()
        for t in [-1, *present]:
            by_site[(p.site, t)].append(p)
    rows, cums = [], defaultdict(float)
    for first, tensors in chunks:
        last = first + int(tensors["steps"]) - 1
        dev = tensors["steps"].device
        for (site, ftype), ps in by_site.items():
            w = torch.stack([p.w.detach() for p in ps]).to(dev, torch.float64)
            r_star = final[site].to(dev)
            if ftype == -1:
                values = chunk_values(tensors, site, r_star, w)
            else:  # each probe its own subset (its feature's labels)
                parts = [chunk_values(tensors, site, r_star, w[j:j + 1],
                                      (p.name, ftype, types[p.name][:, site.pos].to(dev) == ftype))
                         for j, p in enumerate(ps)]
                values = {k: torch.cat([x[k] for x in parts], -1) for k in parts[0]}
            v = {k: x.tolist() for k, x in values.items()}
            for mi, mismatch in enumerate(MISMATCHES):
                for j, p in enumerate(ps):
                    def row(component, optimizer, value):
                        key = (site.layer, site.pos, p.name, ftype, mismatch, component, optimizer)
                        cums[key] += value if component != "risk" else 0.0
                        return {"step": first if component == "risk" else last, "layer": site.layer, "pos": site.pos, "feature": p.name,
                                "feature_type": ftype, "mismatch": mismatch, "component": component,
                                "optimizer": optimizer, "value": value,
                                "cumulative": cums[key] if component != "risk" else value}

                    rows.append(row("risk", "none", v["risk"][mi][j]))
                    kinds: dict[str, dict[str, float]] = defaultdict(dict)
                    for r, (kind, comp) in enumerate(names):
                        kinds[kind][comp] = v["influence"][mi][r][j]
                    for kind, c in kinds.items():
                        c["shared"] = c["full"] - c["direct"] - c["pre_cached"] - c.get("decay", 0.0)
                        rows += [row(comp, kind, c[comp]) for comp in COMPONENTS + (("decay",) * ("decay" in c))]
                    change = v["change"][mi][j]
                    rows += [row("change", "none", change), row("residual", own, kinds[own]["full"] - change)]
    return rows


def account_matrices(kept: KeptAccount) -> dict[str, torch.Tensor]:
    """The influence matrices of a kept account's own rows in the replay's ``matrices.safetensors`` layout
    (:func:`matrices_layout`)."""
    total: dict[Site, torch.Tensor] = {}
    start: dict[Site, torch.Tensor] = {}
    for first, tensors in kept.chunks():
        for site in kept.sites:
            m = chunk_matrices(tensors, site, kept.final[site])
            total[site] = m if site not in total else total[site] + m
            if first == 0:
                start[site] = tensors[f"start.{site.layer}:{site.pos}"]
    return matrices_layout(total, start, kept.final, kept.meta["own"], kept.rows)


def matrices_layout(total: dict[Site, torch.Tensor], start: dict[Site, torch.Tensor], final: dict[Site, torch.Tensor],
                    own: str, names: Sequence[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """An account's influence matrices in ``matrices.safetensors``'s layout (``ntpflow.replay.matrices``), from the
    sums of its chunks' ``chunk_matrices`` ``total`` {site: [2, rows, d, d]}, the readout's residuals at θ_0
    ``start`` and at θ* ``final`` {site: [N, d]} and its rows ``names``: ``M.{site}.{mismatch}.{component}`` of the
    optimizer's own rows ``own`` (direct, pre_cached, shared, full, and decay under AdamW), ``S0.{site}.{mismatch}``
    and ``final_resid.{site}``."""
    out = {}
    for site, m in total.items():
        key, rs = f"{site.layer}:{site.pos}", final[site].to(torch.float64)
        out[f"final_resid.{key}"] = rs
        e = start[site] - rs
        ec = e - e.mean(0)
        for mi, mismatch in enumerate(MISMATCHES):
            c = {comp: m[mi, names.index((kind, comp))] for kind, comp in names if kind == own}
            c["shared"] = c["full"] - c["direct"] - c["pre_cached"] - c.get("decay", 0.0)
            for comp, mc in c.items():
                out[f"M.{key}.{mismatch}.{comp}"] = mc
            out[f"S0.{key}.{mismatch}"] = (e.T @ e if mismatch == "paper" else ec.T @ ec) / len(e)
    return out


def save_account_matrices(out: Path, kept: KeptAccount, meta: dict) -> Path:
    """Write the kept account's matrices to ``out``'s ``matrices.safetensors`` (atomic, sidecar last) with ``meta``."""
    return save_matrices(out, account_matrices(kept), meta)


def rule_text(meta: dict) -> str:
    """The quadrature rule of an account, in words (summary.json's ``rule``)."""
    r = meta["rule"]
    return (f"kept while training: Gauss-Legendre {'/'.join(map(str, r['levels']))} points, then the step split into "
            f"{'/'.join(map(str, r['pieces'])) or 'no'} pieces of {r['levels'][-1]} points each, a step re-integrated "
            f"while the readout's displacement or second moment misses its change by more than {r['rtol']:g} of it "
            f"+ {r['floor']:g} of its size at θ_0, each split after the first kept only if it cuts the worst excess "
            f"by {r['stall']:g}")
