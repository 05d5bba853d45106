"""Linear probes for residual-stream features.

Closed-form ridge regression in torch, batched over all residual sites
(layer ``k`` in ``0..n_layer``, position ``p`` in ``0..T-1``) at once.

Conventions
-----------
* ``resid``: ``[L+1, n, T, d]`` float, the residual stream stacked over layers
  (``L+1`` = embeddings plus one entry per block).
* ``features``: ``[n, T, F]`` float, per-token targets.
* ``feature_types``: optional ``[n, T, F]`` integer labels used for per-type
  metrics.

The fitting procedure mirrors the reference (sklearn ``Ridge(alpha=1.0)``,
``fit_intercept=True``, fitted separately per (layer, position)): the first
``floor(train_frac * n)`` rows are the training set and the remaining rows the
test set, **without shuffling** (rows are assumed to be exchangeable already,
e.g. independently sampled sequences). The metric is Pearson r per feature on
the test rows.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ntpflow.files import atomic_write, load_tensors, read_json, save_tensors, sidecar, write_json
from ntpflow.model.sites import feature_name

logger = logging.getLogger(__name__)

__all__ = [
    "ProbeSet",
    "fit_probes",
    "fit_ridge",
    "pearson",
    "probe_table",
]

TENSORS_FILE = "probes.safetensors"
META_FILE = "probes.json"
TABLE_FILE = "r.csv"  # written by write_r_table, with its sidecar r.json
_FORMAT_VERSION = 1
# Soft cap on float64 working memory per batched chunk of sites.
_CHUNK_BYTES = 512 * 2**20


# --------------------------------------------------------------------------
# helpers


def _compute_dtype(device: torch.device) -> torch.dtype:
    """float64 where the backend supports it (MPS does not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt if dt.is_floating_point else torch.get_default_dtype()


def _chunks(n_sites: int, bytes_per_site: int, chunk_size: int | None) -> Iterator[slice]:
    """Slices over the site axis so that each chunk uses about ``_CHUNK_BYTES``."""
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_BYTES // max(1, bytes_per_site))
    for start in range(0, n_sites, chunk_size):
        yield slice(start, min(start + chunk_size, n_sites))


# --------------------------------------------------------------------------
# ridge + pearson


def fit_ridge(
    X: torch.Tensor,
    Y: torch.Tensor,
    alpha: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched ridge regression with intercept, one independent fit per site.

    Same solution as ``sklearn.linear_model.Ridge(alpha, fit_intercept=True)``
    per site: X and Y are centred over N, ``(XcᵀXc + αI) W = XcᵀYc`` is solved
    (Cholesky), and ``b = ȳ − x̄ W``. Computed in float64, returned in the
    (promoted) input dtype, on the input device.

    Args:
        X: ``[S, N, d]`` inputs.
        Y: ``[S, N, F]`` targets.
        alpha: L2 penalty (``>= 0``; the intercept is not penalised).
        chunk_size: sites solved per batched call; ``None`` picks a size that
            keeps float64 working memory around 512 MiB.

    Returns:
        ``W`` ``[S, d, F]`` and ``b`` ``[S, F]``.
    """
    if X.ndim != 3 or Y.ndim != 3:
        raise ValueError(
            f"fit_ridge expects X [S, N, d] and Y [S, N, F]; got {tuple(X.shape)} and {tuple(Y.shape)}"
        )
    if X.shape[:2] != Y.shape[:2]:
        raise ValueError(
            f"fit_ridge: X and Y disagree on [S, N]: {tuple(X.shape[:2])} vs {tuple(Y.shape[:2])}"
        )
    if X.shape[1] < 1:
        raise ValueError("fit_ridge: need at least one row (N >= 1)")
    alpha = float(alpha)
    if not alpha >= 0.0:
        raise ValueError(f"fit_ridge: alpha must be >= 0, got {alpha}")

    S, N, d = X.shape
    F = Y.shape[2]
    out_dtype = _out_dtype(X, Y)
    cdt = _compute_dtype(X.device)
    W = torch.empty(S, d, F, dtype=out_dtype, device=X.device)
    b = torch.empty(S, F, dtype=out_dtype, device=X.device)
    eye = torch.eye(d, dtype=cdt, device=X.device)
    bytes_per_site = 8 * (2 * d * d + 2 * N * d + 2 * N * F + 2 * d * F)

    for sl in _chunks(S, bytes_per_site, chunk_size):
        x = X[sl].to(device=X.device, dtype=cdt)
        y = Y[sl].to(device=X.device, dtype=cdt)
        x_mean = x.mean(dim=1, keepdim=True)  # [s, 1, d]
        y_mean = y.mean(dim=1, keepdim=True)  # [s, 1, F]
        xc = x - x_mean
        yc = y - y_mean
        A = xc.transpose(1, 2) @ xc + alpha * eye  # [s, d, d]
        B = xc.transpose(1, 2) @ yc  # [s, d, F]
        L, info = torch.linalg.cholesky_ex(A)
        if bool((info == 0).all()):
            w = torch.cholesky_solve(B, L)
        else:
            # Only reachable with alpha == 0 and rank-deficient X (or non-finite
            # input); fall back to the minimum-norm solution like sklearn's lstsq.
            logger.warning(
                "fit_ridge: %d of %d systems not positive definite (alpha=%g); using pinv",
                int((info != 0).sum()),
                A.shape[0],
                alpha,
            )
            w = torch.linalg.pinv(A, hermitian=True) @ B
        W[sl] = w.to(out_dtype)
        b[sl] = (y_mean - x_mean @ w).squeeze(1).to(out_dtype)
    return W, b


def pearson(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Pearson correlation over the N axis.

    Args:
        pred, target: ``[..., N, F]`` (broadcastable to each other).

    Returns:
        ``r`` ``[..., F]``. NaN where either side is constant over N (zero
        variance) or N < 2; NaN inputs propagate to NaN.
    """
    pred, target = torch.broadcast_tensors(pred, target)
    if pred.ndim < 2:
        raise ValueError(f"pearson expects [..., N, F] tensors; got shape {tuple(pred.shape)}")
    out_dtype = _out_dtype(pred, target)
    cdt = _compute_dtype(pred.device)
    return _masked_pearson(pred.to(cdt), target.to(cdt), None).to(out_dtype)


def _masked_pearson(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Pearson r over dim -2 using only entries where ``mask`` is True.

    ``x``, ``y``: ``[..., N, F]`` (same dtype); ``mask`` broadcastable bool or
    ``None`` (all entries). Returns ``[..., F]``; NaN where fewer than 2 entries
    or where either side is constant over the selected entries.
    """
    if mask is None:
        n = torch.full(x.shape[:-2] + x.shape[-1:], x.shape[-2], dtype=x.dtype, device=x.device)
        mx = x.mean(dim=-2, keepdim=True)
        my = y.mean(dim=-2, keepdim=True)
        xc, yc = x - mx, y - my
        const_x = x.amax(dim=-2) == x.amin(dim=-2) if x.shape[-2] else torch.ones_like(n, dtype=torch.bool)
        const_y = y.amax(dim=-2) == y.amin(dim=-2) if y.shape[-2] else torch.ones_like(n, dtype=torch.bool)
    else:
        mask = torch.broadcast_to(mask, x.shape)
        m = mask.to(x.dtype)
        n = m.sum(dim=-2)
        safe_n = n.clamp_min(1).unsqueeze(-2)
        # where() rather than multiplication so that NaN/inf outside the mask is ignored
        xz = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
        yz = torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))
        mx = xz.sum(dim=-2, keepdim=True) / safe_n
        my = yz.sum(dim=-2, keepdim=True) / safe_n
        xc = torch.where(mask, x - mx, torch.zeros((), dtype=x.dtype, device=x.device))
        yc = torch.where(mask, y - my, torch.zeros((), dtype=y.dtype, device=y.device))
        inf = torch.tensor(math.inf, dtype=x.dtype, device=x.device)
        const_x = torch.where(mask, x, -inf).amax(dim=-2) == torch.where(mask, x, inf).amin(dim=-2)
        const_y = torch.where(mask, y, -inf).amax(dim=-2) == torch.where(mask, y, inf).amin(dim=-2)
    sxy = (xc * yc).sum(dim=-2)
    sxx = (xc * xc).sum(dim=-2)
    syy = (yc * yc).sum(dim=-2)
    r = sxy / torch.sqrt(sxx * syy)
    r = r.clamp(-1.0, 1.0)  # rounding; clamp keeps NaN as NaN
    bad = const_x | const_y | (n < 2)
    return torch.where(bad, torch.full_like(r, math.nan), r)


# --------------------------------------------------------------------------
# ProbeSet


@dataclass(eq=False)
class ProbeSet:
    """A grid of fitted linear probes, one per (layer, position) site.

    Attributes:
        weights: ``[L+1, T, d, F]``; NaN at positions that were not probed.
        bias: ``[L+1, T, F]``; NaN at positions that were not probed.
        feature_names: ``F`` names.
        alpha: ridge penalty used.
        train_frac: fraction of rows (the first ones, unshuffled) used to fit.
        positions: probed positions (sorted).
        r: ``[L+1, T, F]`` test-set Pearson r; NaN where not probed or undefined.
        r_by_type: ``{type: [L+1, T, F]}`` test-set r restricted to rows whose
            feature type equals ``type`` (per feature); NaN where fewer than two
            such rows or zero variance.
        metadata: JSON-serialisable extras (``fit_probes`` stores ``n_train``,
            ``n_test``).
    """

    weights: torch.Tensor
    bias: torch.Tensor
    feature_names: tuple[str, ...]
    alpha: float
    train_frac: float
    positions: tuple[int, ...]
    r: torch.Tensor
    r_by_type: dict[int, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.feature_names = tuple(feature_name(str(n)) for n in self.feature_names)  # old toy names read as new
        self.positions = tuple(int(p) for p in self.positions)
        self.alpha = float(self.alpha)
        self.train_frac = float(self.train_frac)
        self.r_by_type = {int(k): v for k, v in self.r_by_type.items()}
        if self.weights.ndim != 4:
            raise ValueError(f"ProbeSet.weights must be [L+1, T, d, F]; got {tuple(self.weights.shape)}")
        L1, T, _, F = self.weights.shape
        if tuple(self.bias.shape) != (L1, T, F):
            raise ValueError(f"ProbeSet.bias must be {(L1, T, F)}; got {tuple(self.bias.shape)}")
        if tuple(self.r.shape) != (L1, T, F):
            raise ValueError(f"ProbeSet.r must be {(L1, T, F)}; got {tuple(self.r.shape)}")
        for t, v in self.r_by_type.items():
            if tuple(v.shape) != (L1, T, F):
                raise ValueError(f"ProbeSet.r_by_type[{t}] must be {(L1, T, F)}; got {tuple(v.shape)}")
        if len(self.feature_names) != F:
            raise ValueError(f"ProbeSet: {len(self.feature_names)} feature names for F={F} features")
        if any(not 0 <= p < T for p in self.positions):
            raise ValueError(f"ProbeSet: positions {self.positions} out of range [0, {T})")

    # shape helpers ------------------------------------------------------
    @property
    def n_sites_layers(self) -> int:
        """``L+1``."""
        return self.weights.shape[0]

    @property
    def n_positions(self) -> int:
        """``T``."""
        return self.weights.shape[1]

    @property
    def d_model(self) -> int:
        """``d_model``."""
        return self.weights.shape[2]

    def feature_index(self, feature: int | str) -> int:
        """Index of a feature given by index or name."""
        if isinstance(feature, str):
            try:
                return self.feature_names.index(feature_name(feature))
            except ValueError:
                raise ValueError(f"unknown feature {feature!r}; have {self.feature_names}") from None
        F = len(self.feature_names)
        if not -F <= int(feature) < F:
            raise IndexError(f"feature index {feature} out of range for F={F}")
        return int(feature) % F

    # API ------------------------------------------------------------------
    def direction(self, layer: int, pos: int, feature: int | str) -> torch.Tensor:
        """Weight vector ``[d]`` of ``feature`` at site (layer, pos)."""
        if pos not in self.positions:
            raise ValueError(f"position {pos} was not probed (probed: {self.positions})")
        return self.weights[layer, pos, :, self.feature_index(feature)]

    def predict(self, resid: torch.Tensor) -> torch.Tensor:
        """Apply every site's probe: resid ``[L+1, n, T, d]`` → ``[L+1, n, T, F]``.

        Unprobed positions give NaN. Output is in the weights' dtype, on
        ``resid``'s device.
        """
        L1, T, d, _ = self.weights.shape
        if resid.ndim != 4 or resid.shape[0] != L1 or resid.shape[2] != T or resid.shape[3] != d:
            raise ValueError(
                f"predict expects resid [L+1={L1}, n, T={T}, d={d}]; got {tuple(resid.shape)}"
            )
        W = self.weights.to(resid.device)
        b = self.bias.to(resid.device)
        x = resid.to(W.dtype)
        return torch.einsum("lntd,ltdf->lntf", x, W) + b[:, None]

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``probes.safetensors`` and ``probes.json`` into ``directory``.

        Each file is written to a temporary file in the same directory and
        moved into place with ``os.replace`` (atomic per file).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            "weights": self.weights,
            "bias": self.bias,
            "r": self.r,
            **{f"r_by_type.{t}": v for t, v in self.r_by_type.items()},
        }
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        meta = {
            "format_version": _FORMAT_VERSION,
            "feature_names": list(self.feature_names),
            "alpha": self.alpha,
            "train_frac": self.train_frac,
            "positions": list(self.positions),
            "types": sorted(self.r_by_type),
            "shape": {
                "n_layers_plus_1": self.weights.shape[0],
                "n_positions": self.weights.shape[1],
                "d_model": self.weights.shape[2],
                "n_features": self.weights.shape[3],
            },
            "metadata": self.metadata,
        }
        meta_text = json.dumps(meta, indent=2, allow_nan=False)

        save_tensors(directory / TENSORS_FILE, tensors)
        atomic_write(directory / META_FILE, meta_text)

    @staticmethod
    def saved(directory: str | os.PathLike[str]) -> bool:
        """Whether ``directory`` holds a saved ProbeSet (:meth:`save` writes ``probes.json`` last)."""
        return (Path(directory) / META_FILE).exists()

    @classmethod
    def load(cls, directory: str | os.PathLike[str], device: str | torch.device = "cpu") -> ProbeSet:
        """Read a ProbeSet written by :meth:`save`."""
        directory = Path(directory)
        meta = read_json(directory / META_FILE)
        version = meta.get("format_version")
        if version != _FORMAT_VERSION:
            raise ValueError(f"{directory / META_FILE}: unsupported format_version {version!r}")
        tensors = load_tensors(directory / TENSORS_FILE, device)  # a truncated file: a one-line error naming it
        r_by_type = {int(t): tensors[f"r_by_type.{t}"] for t in meta["types"]}
        return cls(
            weights=tensors["weights"],
            bias=tensors["bias"],
            feature_names=tuple(meta["feature_names"]),
            alpha=meta["alpha"],
            train_frac=meta["train_frac"],
            positions=tuple(meta["positions"]),
            r=tensors["r"],
            r_by_type=r_by_type,
            metadata=meta.get("metadata", {}),
        )


# --------------------------------------------------------------------------
# fitting


def _checked_probe_inputs(resid: torch.Tensor, features: torch.Tensor, alpha, train_frac, positions, feature_types,
                          feature_names) -> tuple[tuple[str, ...], tuple[int, ...], int, int, float, float]:
    """The arguments of :func:`fit_probes` checked (ValueError, one line each): (feature names, positions, train rows,
    test rows, alpha, train_frac)."""
    if resid.ndim != 4:
        raise ValueError(f"resid must be [L+1, n, T, d]; got shape {tuple(resid.shape)}")
    if features.ndim != 3:
        raise ValueError(f"features must be [n, T, F]; got shape {tuple(features.shape)}")
    L1, n, T, d = resid.shape
    if tuple(features.shape[:2]) != (n, T):
        raise ValueError(
            f"features [n, T, F]={tuple(features.shape)} does not match resid [L+1, n, T, d]={tuple(resid.shape)}"
        )
    F = features.shape[2]
    if F < 1:
        raise ValueError("features must have at least one feature (F >= 1)")
    if feature_types is not None:
        if tuple(feature_types.shape) != tuple(features.shape):
            raise ValueError(
                f"feature_types shape {tuple(feature_types.shape)} must equal features shape {tuple(features.shape)}"
            )
        if feature_types.dtype.is_floating_point or feature_types.is_complex():
            raise ValueError(f"feature_types must be an integer tensor; got {feature_types.dtype}")
    if feature_names is None:
        names = tuple(f"f{i}" for i in range(F))
    else:
        names = tuple(str(s) for s in feature_names)
        if len(names) != F:
            raise ValueError(f"got {len(names)} feature_names for F={F} features")
        if len(set(names)) != F:
            raise ValueError(f"feature_names must be unique; got {names}")
    alpha = float(alpha)
    if not alpha >= 0.0:
        raise ValueError(f"alpha must be >= 0; got {alpha}")
    train_frac = float(train_frac)
    if not 0.0 < train_frac < 1.0:
        raise ValueError(f"train_frac must be in (0, 1); got {train_frac}")
    n_train = math.floor(train_frac * n)
    n_test = n - n_train
    if n_train < 2 or n_test < 2:
        raise ValueError(
            f"too few rows: n={n} with train_frac={train_frac} gives {n_train} train / {n_test} test rows (need >= 2 each)"
        )
    if positions is None:
        pos = tuple(range(1, T))
    else:
        pos = tuple(sorted({int(p) for p in positions}))
        bad = [p for p in pos if not 0 <= p < T]
        if bad:
            raise ValueError(f"positions {bad} out of range [0, {T})")
    if not pos:
        raise ValueError(f"no positions to probe (T={T}; position 0 is skipped by default)")
    if not resid.dtype.is_floating_point:
        raise ValueError(f"resid must be a float tensor; got {resid.dtype}")
    return names, pos, n_train, n_test, alpha, train_frac


def fit_probes(
    resid: torch.Tensor | Sequence[torch.Tensor],
    features: torch.Tensor,
    *,
    alpha: float = 1.0,
    train_frac: float = 0.7,
    positions: Sequence[int] | None = None,
    feature_types: torch.Tensor | None = None,
    feature_names: Sequence[str] | None = None,
    chunk_size: int | None = None,
) -> ProbeSet:
    """Fit ridge probes at every (layer, position) site in one batched solve.

    Args:
        resid: ``[L+1, n, T, d]`` (or a sequence of ``L+1`` ``[n, T, d]``).
        features: ``[n, T, F]`` targets.
        alpha: ridge penalty (sklearn ``Ridge(alpha)`` semantics, with intercept).
        train_frac: the first ``floor(train_frac * n)`` rows train, the rest
            test; rows are **not** shuffled.
        positions: positions to probe; default ``1..T-1`` (position 0, BOS,
            is skipped).
        feature_types: optional integer ``[n, T, F]``; adds per-type test r.
        feature_names: ``F`` unique names; default ``f0..f{F-1}``.
        chunk_size: sites per batched solve (memory cap); see :func:`fit_ridge`.

    Returns:
        A :class:`ProbeSet` (weights in resid's float dtype, on resid's device).
    """
    if not isinstance(resid, torch.Tensor):
        resid = torch.stack(list(resid))
    names, pos, n_train, n_test, alpha, train_frac = _checked_probe_inputs(
        resid, features, alpha, train_frac, positions, feature_types, feature_names)
    L1, n, T, d = resid.shape
    F = features.shape[2]
    P = len(pos)

    device = resid.device
    out_dtype = resid.dtype
    cdt = _compute_dtype(device)
    pos_idx = torch.tensor(pos, dtype=torch.long, device=device)
    features = features.to(device)

    # Sites are ordered (layer, position) -> s = layer * P + i.
    def sites_x(rows: slice) -> torch.Tensor:  # [L1*P, N, d]
        x = resid[:, rows].index_select(2, pos_idx)  # [L1, N, P, d]
        return x.permute(0, 2, 1, 3).reshape(L1 * P, -1, d)

    def sites_y(rows: slice) -> torch.Tensor:  # [P, N, F]
        return features[rows].index_select(1, pos_idx).permute(1, 0, 2)

    tr, te = slice(0, n_train), slice(n_train, n)
    y_tr = sites_y(tr)
    Y_tr = y_tr.unsqueeze(0).expand(L1, P, n_train, F).reshape(L1 * P, n_train, F)
    W, b = fit_ridge(sites_x(tr), Y_tr.to(cdt), alpha, chunk_size=chunk_size)  # float64 (Y is)

    # Test predictions in float64, chunked over sites.
    X_te = sites_x(te)
    pred = torch.empty(L1 * P, n_test, F, dtype=cdt, device=device)
    for sl in _chunks(L1 * P, 8 * (n_test * d + d * F + 2 * n_test * F), chunk_size):
        pred[sl] = X_te[sl].to(cdt) @ W[sl] + b[sl, None, :]
    pred = pred.reshape(L1, P, n_test, F)
    y_te = sites_y(te).to(cdt).unsqueeze(0)  # [1, P, n_test, F]

    def scatter(vals: torch.Tensor, trailing: tuple[int, ...]) -> torch.Tensor:
        full = torch.full((L1, T, *trailing), math.nan, dtype=out_dtype, device=device)
        full[:, pos_idx] = vals.reshape(L1, P, *trailing).to(out_dtype)
        return full

    r = scatter(_masked_pearson(pred, y_te, None), (F,))
    r_by_type: dict[int, torch.Tensor] = {}
    if feature_types is not None:
        t_te = feature_types.to(device)[te].index_select(1, pos_idx).permute(1, 0, 2)  # [P, n_test, F]
        for t in torch.unique(t_te).tolist():
            mask = (t_te == t).unsqueeze(0)
            r_by_type[int(t)] = scatter(_masked_pearson(pred, y_te, mask), (F,))

    weights = scatter(W, (d, F))
    bias = scatter(b, (F,))
    logger.debug(
        "fit_probes: %d layers x %d positions, d=%d, F=%d, train=%d, test=%d, alpha=%g",
        L1, P, d, F, n_train, n_test, alpha,
    )
    return ProbeSet(
        weights=weights,
        bias=bias,
        feature_names=names,
        alpha=alpha,
        train_frac=train_frac,
        positions=pos,
        r=r,
        r_by_type=r_by_type,
        metadata={"n_train": n_train, "n_test": n_test},
    )


# --------------------------------------------------------------------------
# display


def probe_table(
    probes: ProbeSet,
    feature: int | str,
    positions: Sequence[int] | None = None,
    baseline: ProbeSet | None = None,
) -> str:
    """Plain-text table of test r for one feature: rows = layers, columns = positions.

    Values use 2 decimals; NaN (unprobed / undefined) is shown as ``"  - "``.
    ``positions`` defaults to the probed positions. With ``baseline`` (the same probes of the initial weights) each
    cell reads ``r (r_init)``.
    """
    fi = probes.feature_index(feature)
    cols = list(probes.positions if positions is None else positions)
    r = probes.r[..., fi].detach().to("cpu", torch.float64)
    r0 = None if baseline is None else baseline.r[..., baseline.feature_index(feature)].detach().to("cpu",
                                                                                                    torch.float64)

    def cell(x: torch.Tensor, layer: int, p: int) -> str:
        v = float(x[layer, p]) if p < x.shape[1] else math.nan
        return "  - " if math.isnan(v) else f"{v:5.2f}"

    width = max(5 if r0 is None else 13, *(len(f"p{p}") for p in cols)) if cols else 5
    head = f"r[{probes.feature_names[fi]}] test, alpha={probes.alpha:g}" + ("" if r0 is None else
                                                                           ", each cell: trained (untrained)")
    lines = [head, "layer " + " ".join(f"p{p}".rjust(width) for p in cols)]
    for layer in range(r.shape[0]):
        cells = []
        for p in cols:
            text = cell(r, layer, p).ljust(5)
            if r0 is not None:
                text += f" ({cell(r0, layer, p).strip()})"
            cells.append(text.rjust(width))
        lines.append(f"{layer:>5} " + " ".join(cells))
    return "\n".join(lines)


def write_r_table(directory: str | os.PathLike[str], probes: ProbeSet, baseline: ProbeSet | None,
                  meta: dict) -> Path:
    """Write ``directory``/r.csv, atomically: one row per feature × layer × probed position (in that order) with
    ``r``, the test Pearson r of ``probes``, and ``r_init``, that of ``baseline`` (the initial weights; empty
    without one or where undefined); then ``meta`` (what made it: run, weights, step, stamp) into its sidecar
    r.json. Returns the CSV's path."""
    path = Path(directory) / TABLE_FILE
    r = probes.r.detach().to("cpu", torch.float64)
    r0 = None if baseline is None else baseline.r.detach().to("cpu", torch.float64)

    def num(x: torch.Tensor | None, *idx) -> str:
        v = math.nan if x is None else float(x[idx])
        return "" if math.isnan(v) else repr(v)

    text = io.StringIO()
    rows = csv.writer(text, lineterminator="\n")
    rows.writerow(["feature", "layer", "pos", "r", "r_init"])
    for f, name in enumerate(probes.feature_names):
        f0 = None if baseline is None else baseline.feature_index(name)
        for layer in range(r.shape[0]):
            for p in probes.positions:
                rows.writerow([name, layer, p, num(r, layer, p, f), num(r0, layer, p, f0) if r0 is not None else ""])
    atomic_write(path, text.getvalue())
    write_json(sidecar(path), {**meta, "columns": {
        "r": "test-set Pearson r of the ridge probe of these weights",
        "r_init": "the same of the initial weights (step 0), the untrained baseline"}})
    return path
