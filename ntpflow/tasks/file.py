"""A task read from a file of token sequences with their loss mask and per-position feature labels (docs/tasks.md).

Named ``file:PATH`` wherever a task name goes. The file (``.npz``, ``.safetensors`` or Parquet) holds::

    tokens         int   [N, T]      token ids (0 = <pad>, 1 = <bos> by convention; any ids below the vocabulary)
    loss_mask      bool  [N, T]      row p: does the prediction of token p + 1 count in the loss
    features       float [N, T, F]   the feature labels at each position
    useful         bool  [T, F]      (optional) feature f at position t helps predict token t + 1; default all False
    feature_types  int   [N, T, F]   (optional) per-example feature types
    legal          bool  [N, T, V]   (optional) the legal next tokens, for the legal-move accuracy
    feature_names  strings [F]       (optional; in .npz, or in the .safetensors metadata / Parquet schema metadata as
                                     JSON) default f0..f{F-1}

A run's training set is the first ``n_train`` sequences and its evaluation set the next ``n_eval``; ``sample`` draws
rows at random.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from ntpflow.tasks.base import Batch, Task

FIELDS = ("tokens", "loss_mask", "features", "useful", "feature_types", "legal")
PREFIX = "file:"


def read_arrays(path: Path) -> tuple[dict[str, np.ndarray], list[str] | None]:
    """The arrays of a task file and its feature names (None: not given). ValueError (one line) if unreadable."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            names = arrays.pop("feature_names", None)
            return arrays, None if names is None else [str(n) for n in names]
        if suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="np") as f:
                arrays = {k: f.get_tensor(k) for k in f.keys()}
                meta = f.metadata() or {}
            return arrays, json.loads(meta["feature_names"]) if "feature_names" in meta else None
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            meta = table.schema.metadata or {}
            shapes = json.loads(meta.get(b"shapes", b"{}"))
            arrays = {c: np.asarray(table[c].to_pylist()).reshape(shapes.get(c, (-1,))) for c in table.column_names}
            names = meta.get(b"feature_names")
            return arrays, None if names is None else json.loads(names)
    except Exception as e:  # noqa: BLE001 - an empty, truncated or foreign file, whatever its reader raises
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: cannot read the task file ({reason})") from None
    raise ValueError(f"{path}: a task file is .npz, .safetensors or .parquet, not {suffix or 'without a suffix'}")


class FileTask(Task):
    """The task of a file (see the module docstring); ``FileTask("data.npz")`` or ``task="file:data.npz"``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"task file {self.path} does not exist")
        arrays, names = read_arrays(self.path)
        self.data = _checked(self.path, arrays)
        n, T, F = self.data["features"].shape
        self.name = self.path.stem
        self.seq_len = T
        self.feature_names = tuple(names) if names is not None else tuple(f"f{i}" for i in range(F))
        if len(self.feature_names) != F or len(set(self.feature_names)) != F:
            raise ValueError(f"{self.path}: feature_names must be {F} distinct names, got {list(self.feature_names)}")
        self.useful = self.data.get("useful", np.zeros((T, F), dtype=bool))
        vocab_size = int(self.data["tokens"].max()) + 1
        if "legal" in self.data:
            vocab_size = max(vocab_size, self.data["legal"].shape[2])
        self.vocab = ("<pad>", "<bos>", *(f"t{i}" for i in range(2, max(vocab_size, 3))))
        counted = np.flatnonzero(self.data["loss_mask"].any(0))
        self.first_output_pos = int(counted[0]) if len(counted) else 0

    @cached_property
    def batch(self) -> Batch:
        """Every sequence of the file as one Batch."""
        d = self.data
        return Batch(tokens=d["tokens"], loss_mask=d["loss_mask"], legal=d.get("legal"), features=d["features"],
                     feature_types=d.get("feature_types"))

    def sample(self, n: int, rng: np.random.Generator) -> Batch:
        """``n`` sequences of the file drawn at random (with replacement)."""
        return self.batch[rng.integers(0, len(self.batch), size=n)]

    def make_datasets(self, n_train: int, n_eval: int, seed: int) -> tuple[Batch, Batch]:
        """The first ``n_train`` sequences train, the next ``n_eval`` evaluate (the file's order; ``seed`` unused)."""
        if n_train + n_eval > len(self.batch):
            raise ValueError(f"{self.path} holds {len(self.batch)} sequences; n_train={n_train} + n_eval={n_eval} "
                             "do not fit (set them with --set n_train=... n_eval=...)")
        return self.batch[:n_train], self.batch[n_train:n_train + n_eval]


def _checked(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The task file's arrays in their dtypes, each field's shape checked (ValueError naming the file and field)."""
    for required in ("tokens", "loss_mask", "features"):
        if required not in arrays:
            raise ValueError(f"{path}: missing field {required!r} (a task file needs tokens, loss_mask, features)")
    unknown = sorted(set(arrays) - set(FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known: {', '.join(FIELDS)}, feature_names")
    tokens = arrays["tokens"]
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.min(initial=0) < 0:
        raise ValueError(f"{path}: field 'tokens' must be non-negative integers [N, T], got {tokens.dtype} "
                         f"{list(tokens.shape)}")
    n, T = tokens.shape
    if n == 0 or T < 2:
        raise ValueError(f"{path}: field 'tokens' holds {n} sequences of {T} positions; a task needs at least one "
                         "sequence of two")
    F = arrays["features"].shape[-1] if arrays["features"].ndim == 3 else -1
    want = {"loss_mask": (n, T), "features": (n, T, F), "useful": (T, F), "feature_types": (n, T, F)}
    out: dict[str, np.ndarray] = {"tokens": tokens.astype(np.int64)}
    for field, shape in want.items():
        if field in arrays:
            if arrays[field].shape != shape or F < 1:
                raise ValueError(f"{path}: field {field!r} has shape {list(arrays[field].shape)}, expected "
                                 f"{list(shape) if F >= 1 else '[N, T, F]'} (N={n} sequences, T={T} positions)")
            out[field] = arrays[field]
    if "legal" in arrays:
        if arrays["legal"].ndim != 3 or arrays["legal"].shape[:2] != (n, T):
            raise ValueError(f"{path}: field 'legal' has shape {list(arrays['legal'].shape)}, expected [{n}, {T}, V]")
        out["legal"] = arrays["legal"].astype(bool)
    mask = out["loss_mask"]
    if not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer) and np.isin(mask, (0, 1)).all()):
        raise ValueError(f"{path}: field 'loss_mask' must be boolean (or 0/1), got {mask.dtype}")
    features = out["features"]
    if not (np.issubdtype(features.dtype, np.number) or features.dtype == bool) or not np.isfinite(features).all():
        raise ValueError(f"{path}: field 'features' must be finite numbers, got {features.dtype}"
                         + (" with NaN or inf" if np.issubdtype(features.dtype, np.number) else ""))
    out["loss_mask"] = out["loss_mask"].astype(bool)
    out["features"] = out["features"].astype(np.float32)
    if "useful" in out:
        out["useful"] = out["useful"].astype(bool)
    if "feature_types" in out:
        out["feature_types"] = out["feature_types"].astype(np.int8)
    return out
