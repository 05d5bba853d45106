"""Common containers and the task protocol for synthetic next-token tasks.

Conventions shared by every task:

* Position 0 of every sequence is ``<bos>``; vocabulary ids 0 and 1 are
  ``<pad>`` and ``<bos>``, task symbols start at id 2.
* Logits at position ``p`` predict token ``p + 1``. Every per-position array
  that concerns a *prediction* (``loss_mask``, ``legal``) is aligned with the
  logits, i.e. row ``p`` talks about token ``p + 1``; the last row (``T - 1``)
  has no next token.
* Features are properties of the residual stream *at* position ``t`` (after
  reading token ``t``); ``useful[t, f]`` says whether feature ``f`` at position
  ``t`` helps predict token ``t + 1``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

__all__ = ["BOS_ID", "N_SPECIAL", "PAD_ID", "Batch", "Task", "check_batch", "concat_batches"]

PAD_ID = 0
BOS_ID = 1
N_SPECIAL = 2  # number of special tokens before the task symbols


@dataclass(frozen=True)
class Batch:
    """A batch of ``n`` sequences of length ``T`` with ``F`` features and vocab ``V``.

    Attributes:
        tokens: int64 ``[n, T]``; ``tokens[:, 0]`` is ``<bos>``.
        loss_mask: bool ``[n, T]``; ``loss_mask[:, p]`` says whether the
            prediction made at position ``p`` (of token ``p + 1``) counts in the loss.
        legal: bool ``[n, T, V]`` or None; ``legal[:, p, v]`` says whether ``v`` is a
            legal value of token ``p + 1``. Row ``T - 1`` is all False. None for natural
            text, where legality is undefined (and ``[n, T, V]`` would not fit in memory).
        features: float32 ``[n, T, F]`` ground-truth feature values at each position, or None in a token-only
            training set (a task whose ground truth is costly keeps it for the evaluation set only, e.g. Othello).
        feature_types: optional int8 ``[n, T, F]`` per-example feature type
            (task specific, e.g. empty / NTP-useless / NTP-useful), or None.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    legal: np.ndarray | None
    features: np.ndarray | None
    feature_types: np.ndarray | None = None

    def __post_init__(self) -> None:
        n, T = self.tokens.shape
        if self.loss_mask.shape != (n, T):
            raise ValueError(f"loss_mask shape {self.loss_mask.shape} != {(n, T)}")
        if self.legal is not None and (self.legal.ndim != 3 or self.legal.shape[:2] != (n, T)):
            raise ValueError(f"legal shape {self.legal.shape} != {(n, T)} + (V,)")
        if self.features is None:
            if self.feature_types is not None:
                raise ValueError("a token-only batch (features None) cannot hold feature_types")
        elif self.features.ndim != 3 or self.features.shape[:2] != (n, T):
            raise ValueError(f"features shape {self.features.shape} != {(n, T)} + (F,)")
        elif self.feature_types is not None and self.feature_types.shape != self.features.shape:
            raise ValueError(
                f"feature_types shape {self.feature_types.shape} != features shape "
                f"{self.features.shape}"
            )

    @property
    def seq_len(self) -> int:
        """Sequence length ``T``."""
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, idx) -> Batch:
        """Select rows (int, slice, integer or boolean array); always returns a Batch.

        An integer index returns a batch of one sequence.
        """
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if not -len(self) <= i < len(self):
                raise IndexError(f"index {i} out of range for batch of size {len(self)}")
            idx = slice(i, i + 1) if i != -1 else slice(i, None)
        return Batch(
            tokens=self.tokens[idx],
            loss_mask=self.loss_mask[idx],
            legal=None if self.legal is None else self.legal[idx],
            features=None if self.features is None else self.features[idx],
            feature_types=None if self.feature_types is None else self.feature_types[idx],
        )


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches along the sequence (row) axis."""
    batches = list(batches)
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    has_features = [b.features is not None for b in batches]
    if any(has_features) and not all(has_features):
        raise ValueError("cannot concatenate token-only batches with batches that hold features")
    has_types = [b.feature_types is not None for b in batches]
    if any(has_types) and not all(has_types):
        raise ValueError("cannot concatenate batches with and without feature_types")
    has_legal = [b.legal is not None for b in batches]
    if any(has_legal) and not all(has_legal):
        raise ValueError("cannot concatenate batches with and without legal masks")
    # each list below is the whole of its field's arrays where all(has_...) (the only case it is concatenated)
    legal = [b.legal for b in batches if b.legal is not None]
    features = [b.features for b in batches if b.features is not None]
    feature_types = [b.feature_types for b in batches if b.feature_types is not None]
    return Batch(
        tokens=np.concatenate([b.tokens for b in batches], axis=0),
        loss_mask=np.concatenate([b.loss_mask for b in batches], axis=0),
        legal=np.concatenate(legal, axis=0) if all(has_legal) else None,
        features=np.concatenate(features, axis=0) if all(has_features) else None,
        feature_types=np.concatenate(feature_types, axis=0) if all(has_types) else None,
    )


@runtime_checkable
class Task(Protocol):
    """A synthetic sequence task with ground-truth features.

    Attributes:
        name: registry name of the task.
        vocab: token strings, index = token id (``vocab[0] == "<pad>"``, ``vocab[1] == "<bos>"``).
        seq_len: ``T``, sequence length including ``<bos>``.
        feature_names: the ``F`` feature names.
        useful: bool ``[T, F]``; whether feature ``f`` at position ``t`` is
            NTP-useful (helps predict token ``t + 1``).
        first_output_pos: position whose logits predict the first output token.
        config_fields: the ``TrainConfig`` fields the task is built with (passed to its constructor by
            name); default none.

    Optional hooks, with defaults that a task inherits by subclassing ``Task`` explicitly (as the shipped
    tasks do): :attr:`config_fields`, :meth:`make_datasets` and :meth:`save_artifacts`.
    """

    name: str
    vocab: tuple[str, ...]
    seq_len: int
    feature_names: tuple[str, ...]
    useful: np.ndarray
    first_output_pos: int
    config_fields: ClassVar[tuple[str, ...]] = ()

    def sample(self, n: int, rng: np.random.Generator) -> Batch:
        """Draw ``n`` sequences using only ``rng`` for randomness."""
        ...

    def make_datasets(self, n_train: int, n_eval: int, seed: int) -> tuple[Batch, Batch]:
        """(train, eval) sets of ``n_train`` / ``n_eval`` sequences seeded by ``seed``.

        Default: :meth:`sample` from two independent streams, ``default_rng([seed, 0])`` for train and
        ``default_rng([seed, 1])`` for eval. A task that reads a fixed corpus overrides it.
        """
        train = self.sample(n_train, np.random.default_rng([seed, 0]))
        evals = self.sample(n_eval, np.random.default_rng([seed, 1]))
        return train, evals

    def save_artifacts(self, run_dir: str | os.PathLike) -> None:
        """Write what a run needs beside its weights into the new ``run_dir`` (e.g. a tokenizer); default
        nothing."""


def check_batch(task: Task, batch, label: str | None = None) -> Batch:
    """``batch`` if it is a :class:`Batch` that fits ``task``, else a one-line ValueError naming the task (``label``,
    default its ``name``) and what is wrong: its type, the shapes against ``seq_len``, ``vocab`` and
    ``feature_names``, token ids outside the vocabulary, non-finite features, a loss mask that is not boolean or
    counts no prediction. Training calls it on a task's first batch before anything is written."""
    label = label or getattr(task, "name", type(task).__name__)
    where = f"task {label}"
    if not isinstance(batch, Batch):
        raise ValueError(f"{where}: sample() must return an ntpflow Batch, got {type(batch).__name__}")
    n, T = batch.tokens.shape
    F, V = len(task.feature_names), len(task.vocab)
    if T != task.seq_len:
        raise ValueError(f"{where}: sequences of length {T}, but its seq_len is {task.seq_len}")
    if not 0 <= task.first_output_pos < T - 1:
        raise ValueError(f"{where}: first_output_pos {task.first_output_pos} must be in 0..{T - 2}")
    if np.shape(task.useful) != (T, F):
        raise ValueError(f"{where}: useful has shape {list(np.shape(task.useful))}, expected [{T}, {F}] (seq_len, "
                         "feature_names)")
    if not np.issubdtype(batch.tokens.dtype, np.integer):
        raise ValueError(f"{where}: tokens must be integers, got {batch.tokens.dtype}")
    if n and not 0 <= batch.tokens.min() <= batch.tokens.max() < V:
        raise ValueError(f"{where}: token ids {batch.tokens.min()}..{batch.tokens.max()} outside its vocabulary "
                         f"0..{V - 1}")
    if batch.loss_mask.dtype != bool:
        raise ValueError(f"{where}: loss_mask must be boolean, got {batch.loss_mask.dtype}")
    if n and not batch.loss_mask[:, :T - 1].any():
        raise ValueError(f"{where}: loss_mask counts no prediction (row p counts the prediction of token p + 1, "
                         f"p < {T - 1})")
    if batch.legal is not None and batch.legal.shape[2] != V:
        raise ValueError(f"{where}: legal has {batch.legal.shape[2]} columns for a vocabulary of {V}")
    if batch.features is not None:
        if batch.features.shape[2] != F:
            raise ValueError(f"{where}: features have {batch.features.shape[2]} columns for {F} feature_names")
        if not np.issubdtype(batch.features.dtype, np.number) or not np.isfinite(batch.features).all():
            raise ValueError(f"{where}: features must be finite numbers (NaN, inf or {batch.features.dtype} found)")
    return batch
