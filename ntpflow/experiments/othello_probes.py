"""A 3-way linear classifier probe of the Othello board (empty / own / opponent), the metric users of OthelloGPT expect.

The classifier is a **least-squares linear classifier**: closed-form ridge regression (``ntpflow.probes.fit_ridge``,
sklearn ``Ridge(alpha)`` semantics, with intercept) of the one-hot class of every square, then the argmax over the
three scores of each square. It is linear in the residual and has no iterative fitting, so it is deterministic and
fast; a logistic-regression probe could be a little more accurate.

Conventions (those of ``ntpflow.probes`` and ``ntpflow.model.sites``):

* ``resid``: ``[L+1, n, T, d]``; ``resid[0]`` = embeddings, ``resid[k]`` = output of block ``k`` (pre-final-LayerNorm
  for ``k = L``). Position ``t`` holds the state after reading token ``t``; logits at ``p`` predict token ``p + 1``.
* ``features``: ``[n, T, 64]`` board from the mover's view (+1 own, −1 opponent, 0 empty); class 0 = empty,
  1 = own, 2 = opponent (``CLASSES``).
* ``feature_types``: optional ``[n, T, 64]`` ints (0 empty, 1 NTP-useless, 2 NTP-useful) for per-type accuracy.
* Split: the first ``floor(train_frac · n)`` games fit, the rest test, no shuffling (as the ridge probes).
* Accuracy arrays are ``[L+1, T, 64]``, NaN at unprobed positions (default: position 0, ``<bos>``, is skipped) and,
  per type, where the test set has no row of that type.

``classify_run(run, which)`` fits it on a run's eval set and saves ``RUN_DIR/classifier_<which>.safetensors`` with a
JSON sidecar (atomic; the sidecar is written last and marks the file complete); ``load_or_classify`` reuses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ntpflow.files import load_tensors, read_json, resolve_device, save_tensors
from ntpflow.probes import fit_ridge
from ntpflow.runs.probe import collect_resid

__all__ = ["CLASSES", "ClassifierProbes", "board_classes", "classify_run", "fit_classifier", "load_or_classify"]

CLASSES = ("empty", "own", "opponent")
_FORMAT_VERSION = 1


def board_classes(features: torch.Tensor) -> torch.Tensor:
    """Class ids (0 empty, 1 own, 2 opponent) of board values +1/−1/0, same shape, int64; other values raise."""
    f = torch.as_tensor(features)
    cls = torch.full(f.shape, -1, dtype=torch.long, device=f.device)
    cls[f == 0] = 0
    cls[f == 1] = 1
    cls[f == -1] = 2
    if bool((cls < 0).any()):
        raise ValueError("board features must be +1 (own), -1 (opponent) or 0 (empty)")
    return cls


@dataclass
class ClassifierProbes:
    """Test accuracy of the least-squares 3-way classifier at every (layer, position, square).

    ``acc``: ``[L+1, T, F]`` float64; ``acc_by_type[t]``: the same over the test rows whose type is ``t``;
    ``count_by_type[t]``: ``[T, F]`` number of those test rows (the same for every layer).
    """

    acc: torch.Tensor
    acc_by_type: dict[int, torch.Tensor]
    count_by_type: dict[int, torch.Tensor]
    feature_names: tuple[str, ...]
    positions: tuple[int, ...]
    alpha: float
    train_frac: float
    metadata: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write ``path`` (safetensors) and its ``.json`` sidecar, each atomically, the sidecar last."""
        tensors = {"acc": self.acc, **{f"acc_by_type.{t}": v for t, v in self.acc_by_type.items()},
                   **{f"count_by_type.{t}": v for t, v in self.count_by_type.items()}}
        meta = {"format_version": _FORMAT_VERSION, "kind": "least-squares linear classifier (ridge on one-hot, argmax)",
                "classes": list(CLASSES), "feature_names": list(self.feature_names),
                "positions": list(self.positions), "alpha": self.alpha, "train_frac": self.train_frac,
                "types": sorted(self.acc_by_type), "metadata": self.metadata}
        save_tensors(path, tensors, meta)

    @classmethod
    def load(cls, path: str | Path) -> ClassifierProbes:
        """Read probes written by :meth:`save`; an unknown ``format_version`` raises ValueError."""
        path = Path(path)
        meta = read_json(path.with_suffix(".json"))
        if meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"{path.with_suffix('.json')}: unsupported format_version {meta.get('format_version')!r}")
        t = load_tensors(path)
        return cls(acc=t["acc"], acc_by_type={int(k): t[f"acc_by_type.{k}"] for k in meta["types"]},
                   count_by_type={int(k): t[f"count_by_type.{k}"] for k in meta["types"]},
                   feature_names=tuple(meta["feature_names"]), positions=tuple(meta["positions"]),
                   alpha=meta["alpha"], train_frac=meta["train_frac"], metadata=meta.get("metadata", {}))


def fit_classifier(resid: torch.Tensor, features: torch.Tensor, *, alpha: float = 1.0, train_frac: float = 0.7,
                   positions: Sequence[int] | None = None, feature_types: torch.Tensor | None = None,
                   feature_names: Sequence[str] | None = None, pos_chunk: int = 8) -> ClassifierProbes:
    """Fit the least-squares 3-way classifier per (layer, position) and score it on the held-out games.

    Args:
        resid: ``[L+1, n, T, d]`` float (module docstring for the layer convention).
        features: ``[n, T, F]`` board values in {+1, −1, 0}.
        alpha: ridge penalty (with intercept, not penalised).
        train_frac: first ``floor(train_frac · n)`` rows fit, the rest test (no shuffling).
        positions: positions to probe, default ``1..T-1``.
        feature_types: optional int ``[n, T, F]``; adds per-type accuracy.
        feature_names: ``F`` names, default ``f0..``.
        pos_chunk: positions solved per batched call (bounds memory).

    Returns:
        ClassifierProbes with ``acc`` ``[L+1, T, F]`` (NaN at unprobed positions).
    """
    if resid.ndim != 4 or not resid.dtype.is_floating_point:
        raise ValueError(f"resid must be a float tensor [L+1, n, T, d]; got {resid.dtype} {tuple(resid.shape)}")
    L1, n, T, _ = resid.shape
    if features.ndim != 3 or tuple(features.shape[:2]) != (n, T):
        raise ValueError(f"features must be [n={n}, T={T}, F]; got {tuple(features.shape)}")
    F = features.shape[2]
    if feature_types is not None and tuple(feature_types.shape) != tuple(features.shape):
        raise ValueError(f"feature_types shape {tuple(feature_types.shape)} != features shape {tuple(features.shape)}")
    if not 0.0 < float(train_frac) < 1.0:
        raise ValueError(f"train_frac must be in (0, 1); got {train_frac}")
    n_tr = math.floor(train_frac * n)
    if n_tr < 2 or n - n_tr < 1:
        raise ValueError(f"too few rows: n={n} with train_frac={train_frac} gives {n_tr} train / {n - n_tr} test rows")
    names = tuple(feature_names) if feature_names is not None else tuple(f"f{i}" for i in range(F))
    if len(names) != F:
        raise ValueError(f"got {len(names)} feature_names for F={F} features")
    pos = tuple(range(1, T)) if positions is None else tuple(sorted({int(p) for p in positions}))
    if not pos or any(not 0 <= p < T for p in pos):
        raise ValueError(f"positions must be a non-empty subset of 0..{T - 1}; got {pos}")
    if pos_chunk < 1:
        raise ValueError(f"pos_chunk must be positive, got {pos_chunk}")

    cls = board_classes(features.cpu())  # [n, T, F]
    onehot = torch.nn.functional.one_hot(cls, 3).to(torch.float64)  # [n, T, F, 3]
    acc = torch.full((L1, T, F), math.nan, dtype=torch.float64)
    types = sorted(torch.unique(feature_types[n_tr:][:, list(pos)]).tolist()) if feature_types is not None else []
    acc_t = {int(t): torch.full((L1, T, F), math.nan, dtype=torch.float64) for t in types}
    cnt_t = {int(t): torch.zeros((T, F), dtype=torch.float64) for t in types}
    ft = None if feature_types is None else feature_types.cpu()
    for c0 in range(0, len(pos), pos_chunk):
        pc = list(pos[c0:c0 + pos_chunk])
        P = len(pc)
        y_tr = onehot[:n_tr, pc].reshape(n_tr, P, F * 3).permute(1, 0, 2)  # [P, n_tr, 3F]
        truth = cls[n_tr:, pc]  # [n_te, P, F]
        for layer in range(L1):
            x = resid[layer][:, pc].permute(1, 0, 2)  # [P, n, d]
            W, b = fit_ridge(x[:, :n_tr], y_tr.to(x.device), alpha)  # [P, d, 3F], [P, 3F]
            scores = x[:, n_tr:].to(W.dtype) @ W + b[:, None, :]  # [P, n_te, 3F]
            pred = scores.reshape(P, n - n_tr, F, 3).argmax(-1).permute(1, 0, 2).cpu()  # [n_te, P, F]
            hit = (pred == truth).to(torch.float64)
            acc[layer, pc] = hit.mean(0)
            for t in types:
                assert ft is not None  # types is empty without feature_types
                m = (ft[n_tr:, pc] == t).to(torch.float64)
                cnt = m.sum(0)
                acc_t[t][layer, pc] = torch.where(cnt > 0, (hit * m).sum(0) / cnt.clamp(min=1), math.nan)
                cnt_t[t][pc] = cnt
    return ClassifierProbes(acc=acc, acc_by_type=acc_t, count_by_type=cnt_t, feature_names=names, positions=pos,
                            alpha=float(alpha), train_frac=float(train_frac),
                            metadata={"n_train": n_tr, "n_test": n - n_tr})


def classify_run(run, which: str | int = "final", *, alpha: float = 1.0, train_frac: float = 0.7,
                 device: str = "auto") -> ClassifierProbes:
    """Fit the classifier on ``run``'s eval set (residuals of the weights ``which``) and save it in the run dir."""
    model = run.load_model(which, resolve_device(device))
    _, eval_set = run.datasets()
    if eval_set.feature_types is None:
        raise ValueError(f"task {run.cfg.task!r} has no feature types; the board classifier is for othello")
    resid = collect_resid(model, torch.as_tensor(eval_set.tokens))
    out = fit_classifier(resid, torch.as_tensor(eval_set.features), alpha=alpha, train_frac=train_frac,
                         feature_types=torch.as_tensor(eval_set.feature_types).long(),
                         feature_names=run.task.feature_names)
    out.metadata["config_hash"] = run.cfg.hash()
    out.metadata["weights"] = str(which)
    out.save(run.classifier_path(which))
    return out


def load_or_classify(run, which: str | int = "final", device: str = "auto") -> ClassifierProbes:
    """The saved classifier accuracies of ``run`` for weights ``which``, fitting them first if absent."""
    path = run.classifier_path(which)
    if path.with_suffix(".json").exists():
        got = ClassifierProbes.load(path)
        if got.metadata.get("config_hash") == run.cfg.hash():
            return got
    return classify_run(run, which, device=device)
