"""Majority and conditioned-majority tasks (docs/paper.md#majority).

Sequence layout (defaults: ``n_inputs=10``, ``n_outputs=10``, ``n_symbols=3``)::

    position  0      1 .. n_inputs        n_inputs+1 .. n_inputs+n_outputs
    token     <bos>  inputs (i.i.d. unif)  outputs

so ``T = 1 + n_inputs + n_outputs`` (21). Vocabulary: ``<pad>``=0, ``<bos>``=1,
``<0>``, ``<1>``, ... = 2, 3, .... Logits at position ``p`` predict token
``p + 1``; position ``n_inputs`` predicts the first output.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ntpflow.tasks.base import BOS_ID, N_SPECIAL, Batch, Task

__all__ = ["CondMajority", "Majority"]


def _sample_from_sets(sets: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``k`` i.i.d. uniform members of each row's set.

    Args:
        sets: bool ``[n, S]``, every row non-empty.
    Returns:
        int64 ``[n, k]`` symbol indices in ``0..S-1``.
    """
    sizes = sets.sum(axis=1)  # [n]
    rank = rng.integers(0, sizes[:, None], size=(sets.shape[0], k))  # [n, k]
    cum = np.cumsum(sets, axis=1)  # [n, S]
    # index of the (rank+1)-th True entry = number of entries whose cumsum <= rank
    return (cum[:, None, :] <= rank[:, :, None]).sum(axis=-1).astype(np.int64)


def _count_dtype(seq_len: int) -> type:
    return np.uint8 if seq_len <= 256 else np.int64


@dataclass(frozen=True)
class _SymbolTask(Task):
    n_inputs: int = 10
    n_outputs: int = 10
    n_symbols: int = 3

    def __post_init__(self) -> None:
        if self.n_inputs < 1 or self.n_outputs < 1 or self.n_symbols < 1:
            raise ValueError("n_inputs, n_outputs and n_symbols must all be >= 1")

    @property
    def vocab(self) -> tuple[str, ...]:
        """Token strings by id: ``<pad>``, ``<bos>``, then ``<0>`` .. ``<n_symbols-1>``."""
        return ("<pad>", "<bos>") + tuple(f"<{v}>" for v in range(self.n_symbols))

    @property
    def vocab_size(self) -> int:
        """Number of token ids: the special tokens plus ``n_symbols``."""
        return N_SPECIAL + self.n_symbols

    @property
    def seq_len(self) -> int:
        """``T = 1 + n_inputs + n_outputs`` (``<bos>``, inputs, outputs)."""
        return 1 + self.n_inputs + self.n_outputs

    @property
    def first_output_pos(self) -> int:
        """``n_inputs``: the position whose logits predict the first output."""
        return self.n_inputs

    @property
    def n_features(self) -> int:
        """Number of features ``F``."""
        return len(self.feature_names)

    @property
    def useful(self) -> np.ndarray:
        """bool ``[T, F]``: True at positions ``t >= n_inputs`` (next token is an output).

        Static (same for every example); the last row ``T - 1`` has no next token
        but is marked like the other output positions.
        """
        u = np.zeros((self.seq_len, self.n_features), dtype=bool)
        u[self.n_inputs :] = True
        return u

    def optimal_loss(self) -> float:
        """The exact optimal expected training loss: the mean over the ``T - 1`` counted positions of the
        entropy of the next token given the prefix (what a Bayes-optimal predictor pays).

        Inputs are i.i.d. uniform (ln S each), and every output is uniform over a set that the prefix fixes, so it
        costs E[ln |set|]; :meth:`_output_entropies` gives those expectations, computed by enumerating all
        ``n_symbols ** n_inputs`` input strings.
        """
        inputs = np.array(list(itertools.product(range(self.n_symbols), repeat=self.n_inputs)), dtype=np.int64)
        outputs = self._output_entropies(inputs).sum()
        return (self.n_inputs * math.log(self.n_symbols) + float(outputs)) / (self.seq_len - 1)

    def _output_entropies(self, inputs: np.ndarray) -> np.ndarray:
        """float ``[n_outputs]``: the mean over input strings ``[n, n_inputs]`` (all equally likely) of the entropy
        of each output given its prefix."""
        raise NotImplementedError

    def _check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] != self.seq_len:
            raise ValueError(f"tokens must have shape [n, {self.seq_len}], got {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got {tokens.dtype}")
        if tokens.size and (
            np.any(tokens[:, 0] != BOS_ID)
            or np.any(tokens[:, 1:] < N_SPECIAL)
            or np.any(tokens[:, 1:] >= self.vocab_size)
        ):
            raise ValueError("tokens must be <bos> followed by task symbols only")
        return tokens.astype(np.int64, copy=False)

    def _draw_inputs(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[n, T]`` with BOS and inputs filled (outputs unset) and input symbols."""
        tokens = np.empty((n, self.seq_len), dtype=np.int64)
        tokens[:, 0] = BOS_ID
        inputs = rng.integers(0, self.n_symbols, size=(n, self.n_inputs), dtype=np.int64)
        tokens[:, 1 : 1 + self.n_inputs] = inputs + N_SPECIAL
        return tokens, inputs

    def _features_and_sets(self, symbols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """From symbols ``[n, T-1]`` (position ``t`` is column ``t - 1``) return features
        float32 ``[n, T, F]`` and output sets bool ``[n, n_outputs, n_symbols]``
        (the legal symbols for the outputs, row ``j`` = output ``j``)."""
        raise NotImplementedError

    def annotate(self, tokens: np.ndarray) -> Batch:
        """Build the :class:`Batch` (loss mask, legal mask, features) for given tokens.

        ``tokens``: int ``[n, T]``, ``<bos>`` followed by task symbols (e.g. a
        prefix from :meth:`sample` continued by a model). ``sample`` returns
        exactly ``annotate`` of the tokens it drew.
        """
        return self._annotate(self._check_tokens(tokens))

    def _annotate(self, tokens: np.ndarray) -> Batch:
        n, T = tokens.shape
        symbols = tokens[:, 1:] - N_SPECIAL  # [n, T - 1], symbol at position t is column t - 1
        loss_mask = np.ones((n, T), dtype=bool)
        loss_mask[:, T - 1] = False
        legal = np.zeros((n, T, self.vocab_size), dtype=bool)
        legal[:, : self.n_inputs, N_SPECIAL:] = True
        features, out_sets = self._features_and_sets(symbols)
        legal[:, self.n_inputs : T - 1, N_SPECIAL:] = out_sets
        return Batch(tokens=tokens, loss_mask=loss_mask, legal=legal, features=features)


@dataclass(frozen=True)
class Majority(_SymbolTask):
    """Majority task: each output is uniform over the current argmax-count set.

    Counts cover the inputs and all earlier outputs, so after the first output
    the remaining outputs repeat it.

    Features (``F = n_symbols``): ``is_majority_v`` at position ``t`` is 1 iff
    the count of ``<v>`` among tokens ``1..t`` equals the maximum count
    (multi-hot on ties; all 1 at ``<bos>``). For ``n_inputs <= p < T - 1``,
    ``legal[:, p, 2:]`` equals the feature row at ``p``.
    """

    name: ClassVar[str] = "majority"

    @property
    def feature_names(self) -> tuple[str, ...]:
        """``is_majority_v`` for each symbol v (``is_majority_<v>`` before 0.2: still read, see
        ``ntpflow.model.sites.feature_name``)."""
        return tuple(f"is_majority_{v}" for v in range(self.n_symbols))

    def _features_and_sets(self, symbols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n, S, n_in = symbols.shape[0], self.n_symbols, self.n_inputs
        counts = np.zeros((n, self.seq_len, S), dtype=_count_dtype(self.seq_len))
        onehot = (symbols[:, :, None] == np.arange(S)).astype(counts.dtype)
        np.cumsum(onehot, axis=1, out=counts[:, 1:])  # counts after position t
        is_max = counts == counts.max(axis=2, keepdims=True)  # [n, T, S]
        return is_max.astype(np.float32), is_max[:, n_in : n_in + self.n_outputs]

    def _output_entropies(self, inputs: np.ndarray) -> np.ndarray:
        # the first output is uniform over the argmax set of the input counts; it then holds the strict maximum,
        # so every later output is determined (entropy 0)
        counts = (inputs[:, :, None] == np.arange(self.n_symbols)).sum(axis=1)
        h = np.zeros(self.n_outputs)
        h[0] = np.log((counts == counts.max(axis=1, keepdims=True)).sum(axis=1)).mean()
        return h

    def sample(self, n: int, rng: np.random.Generator) -> Batch:
        """Draw ``n`` sequences (see class docstring); randomness only from ``rng``."""
        S, n_in = self.n_symbols, self.n_inputs
        tokens, inputs = self._draw_inputs(n, rng)
        counts = (inputs[:, :, None] == np.arange(S)).sum(axis=1)  # [n, S]
        rows = np.arange(n)
        for j in range(self.n_outputs):
            # uniform over the current argmax set, which includes earlier outputs
            is_max = counts == counts.max(axis=1, keepdims=True)
            sym = _sample_from_sets(is_max, 1, rng)[:, 0]
            tokens[:, 1 + n_in + j] = sym + N_SPECIAL
            counts[rows, sym] += 1
        return self._annotate(tokens)


@dataclass(frozen=True)
class CondMajority(_SymbolTask):
    """Conditioned majority: majority over inputs that immediately follow ``<0>``.

    An input at position ``t`` (``2 <= t <= n_inputs``) is counted iff token
    ``t - 1`` is ``<0>``. Outputs are i.i.d. uniform over the argmax set of these
    counts, which is not updated during the output; with no counted input all
    symbols tie.

    Features (``F = n_symbols``): ``prev_is_v`` at position ``t`` is the one-hot
    of token ``t - 1`` (all 0 at ``t = 0`` and ``t = 1``, where ``t - 1`` is
    ``<bos>``). For ``n_inputs <= p < T - 1``, ``legal[:, p, 2:]`` is the
    conditioned set.
    """

    name: ClassVar[str] = "cond_majority"
    key_symbol: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.key_symbol < self.n_symbols:
            raise ValueError(f"key_symbol must be in [0, {self.n_symbols})")

    @property
    def feature_names(self) -> tuple[str, ...]:
        """``prev_is_v`` for each symbol v (``prev_is_<v>`` before 0.2: still read)."""
        return tuple(f"prev_is_{v}" for v in range(self.n_symbols))

    def _cond_set(self, inputs: np.ndarray) -> np.ndarray:
        """Conditioned-majority set bool ``[n, S]`` from input symbols ``[n, n_inputs]``."""
        S = self.n_symbols
        after_key = inputs[:, :-1] == self.key_symbol  # [n, n_inputs - 1]
        follow = inputs[:, 1:]
        counts = ((follow[:, :, None] == np.arange(S)) & after_key[:, :, None]).sum(axis=1)
        return counts == counts.max(axis=1, keepdims=True)  # all True if nothing counted

    def _output_entropies(self, inputs: np.ndarray) -> np.ndarray:
        # every output is i.i.d. uniform over the conditioned set, which the inputs fix
        return np.full(self.n_outputs, np.log(self._cond_set(inputs).sum(axis=1)).mean())

    def _features_and_sets(self, symbols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n, S = symbols.shape[0], self.n_symbols
        features = np.zeros((n, self.seq_len, S), dtype=np.float32)
        # feature at t >= 2 is the one-hot of the symbol at t - 1 (column t - 2)
        features[:, 2:] = symbols[:, :-1, None] == np.arange(S)
        cond_set = self._cond_set(symbols[:, : self.n_inputs])
        return features, np.broadcast_to(cond_set[:, None, :], (n, self.n_outputs, S))

    def sample(self, n: int, rng: np.random.Generator) -> Batch:
        """Draw ``n`` sequences (see class docstring); randomness only from ``rng``."""
        tokens, inputs = self._draw_inputs(n, rng)
        outputs = _sample_from_sets(self._cond_set(inputs), self.n_outputs, rng)
        tokens[:, 1 + self.n_inputs :] = outputs + N_SPECIAL
        return self._annotate(tokens)
