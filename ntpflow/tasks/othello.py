"""OthelloGPT task: random legal Othello games (docs/paper.md#othello).

Sequence layout (``T = 61``)::

    position  0      1 .. 60
    token     <bos>  the 60 game tokens (moves or passes, see ``othello_engine``)

Vocabulary (``V = 67``): ``<pad>`` = 0, ``<bos>`` = 1, ``pass`` = 2, then the squares ``A1`` .. ``H8`` =
3 .. 66 (token id ``3 + s`` for square ``s = 8 * row + col``; ``A1`` top left, ``H1`` top right).

Position convention: logits at position ``p`` predict token ``p + 1``.

* ``loss_mask[:, p]``: True for ``p = 0 .. 59`` (every game token, passes included, as the reference), False
  at ``p = 60``.
* ``legal[:, p, v]``: ``v`` is a legal token ``p + 1``; for ``p < 60`` the legal squares of the player to move
  after token ``p``, or only ``pass`` when there are none (also while padding a finished game); row 60 is all
  False.
* ``features[:, t, s]`` (float32, ``F = 64``, ``sq_A1`` .. ``sq_H8``): the board after reading token ``t``,
  seen by the player to move next (+1 own, -1 opponent, 0 empty). At ``t = 0`` (``<bos>``) this is the
  opening seen by the first mover; the reference stores zeros there (it never probes position 0).
* ``feature_types[:, t, s]`` (int8): 0 empty, 1 NTP-useless, 2 NTP-useful stone (flipping it changes the
  legal moves after token ``t``, i.e. the legal set of token ``t + 1``); at ``t = 0`` the opening's types.

The opening and the game rules are those of :mod:`ntpflow.tasks.othello_engine` (standard opening; the
reference uses its mirror image).

``Othello(board_size=6)`` (TrainConfig ``board_size=6``) plays on a 6×6 board, a fallback that is NOT the paper's
setting: ``T = 33`` (``<bos>`` + 32 game tokens), ``V = 39`` (the three specials, then the 36 squares ``B2`` ..
``G7``, named as on the 8×8 board they sit in the middle of; token id ``3 + s`` for square ``s = 6 * row + col``),
``F = 36`` features ``sq_B2`` .. ``sq_G7``; every convention above holds with 32 for 60 and 36 for 64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ntpflow.tasks.base import BOS_ID, Batch, Task
from ntpflow.tasks.othello_engine import (
    PASS,
    START_OPP,
    START_OWN,
    Board,
    OthelloGames,
    bitboard_to_mask,
    board,
    legal_moves,
    play_moves,
    random_games,
    random_moves,
    square_types,
)

__all__ = ["PASS_ID", "SQUARE_OFFSET", "Othello"]

PASS_ID = 2  #: token id of ``pass``
SQUARE_OFFSET = 3  #: token id of square ``s`` is ``SQUARE_OFFSET + s``


@dataclass(frozen=True)
class Othello(Task):
    """Random legal Othello games as a :class:`~ntpflow.tasks.base.Task` (see module docstring).

    ``useful`` is static while Othello usefulness is per example (``feature_types == 2``); it is all True,
    meaning "any square may be useful at any position": use ``Batch.feature_types`` for the real split.

    ``board_size``: 8 (the paper's) or 6 (a fallback, not the paper's setting; module docstring).
    """

    board_size: int = 8

    name: ClassVar[str] = "othello"
    config_fields: ClassVar[tuple[str, ...]] = ("board_size",)  # TrainConfig fields passed to the constructor

    def __post_init__(self) -> None:
        board(self.board_size)  # ValueError unless 6 or 8

    @property
    def board(self) -> Board:
        """The board's geometry (``othello_engine.Board``)."""
        return board(self.board_size)

    @property
    def vocab(self) -> tuple[str, ...]:
        """Token strings by id: ``<pad>``, ``<bos>``, ``pass``, then the squares (``A1`` .. ``H8``; 6×6: ``B2`` ..
        ``G7``)."""
        return ("<pad>", "<bos>", "pass") + self.board.names

    @property
    def vocab_size(self) -> int:
        """``V = 67`` (6×6: 39): three special tokens plus the 64 (36) squares."""
        return SQUARE_OFFSET + self.board.n_squares

    @property
    def seq_len(self) -> int:
        """``T = 61`` (6×6: 33): ``<bos>`` and the 60 (32) game tokens."""
        return 1 + self.board.game_len

    @property
    def first_output_pos(self) -> int:
        """0: the logits at ``<bos>`` predict the first move."""
        return 0

    @property
    def feature_names(self) -> tuple[str, ...]:
        """``sq_A1`` .. ``sq_H8`` (6×6: ``sq_B2`` .. ``sq_G7``), one per square."""
        return tuple(f"sq_{s}" for s in self.board.names)

    @property
    def n_features(self) -> int:
        """``F = 64`` (6×6: 36), one per square."""
        return self.board.n_squares

    @property
    def useful(self) -> np.ndarray:
        """bool ``[T, F]``, all True (usefulness is per example: ``feature_types == 2``)."""
        return np.ones((self.seq_len, self.n_features), dtype=bool)

    def sample(self, n: int, rng: np.random.Generator) -> Batch:
        """Draw ``n`` random games (randomness only from ``rng``, a ``np.random.Generator``)."""
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy Generator, got {type(rng).__name__}")  # noqa: TRY004
        return self._batch(random_games(n, rng, size=self.board_size))

    def sample_tokens(self, n: int, rng: np.random.Generator) -> Batch:
        """The tokens and loss mask of ``sample(n, rng)`` only (a token-only :class:`Batch`: ``legal``, ``features``
        and ``feature_types`` None): 6-16x faster (benchmarks/bench_othello.py) and 549 bytes a game instead of
        24,156."""
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy Generator, got {type(rng).__name__}")  # noqa: TRY004
        return Batch(tokens=self._tokens(random_moves(n, rng, size=self.board_size)), loss_mask=self._loss_mask(n), legal=None,
                     features=None)

    def make_datasets(self, n_train: int, n_eval: int, seed: int) -> tuple[Batch, Batch]:
        """A token-only training set (:meth:`sample_tokens`, the same games as ``sample`` would draw) and a full
        evaluation set (boards, legal moves and square types) from the base task's streams ``[seed, 0]`` and
        ``[seed, 1]``. Training reads tokens only; probes, the legal-move accuracy and the exact account's readout
        read the evaluation set."""
        train = self.sample_tokens(n_train, np.random.default_rng([seed, 0]))
        evals = self.sample(n_eval, np.random.default_rng([seed, 1]))
        return train, evals

    def annotate(self, tokens: np.ndarray) -> Batch:
        """Build the :class:`Batch` of given token sequences int ``[n, T]`` (``<bos>`` + the legal game tokens).

        ``sample`` returns exactly ``annotate`` of the tokens it drew. Raises ``ValueError`` on an illegal game.
        """
        tokens = np.asarray(tokens)
        T = self.seq_len
        if tokens.ndim != 2 or tokens.shape[1] != T or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array of shape [n, {T}], got {tokens.dtype} {tokens.shape}")
        body = tokens[:, 1:]
        if tokens.size and (np.any(tokens[:, 0] != BOS_ID) or np.any(body < PASS_ID) or np.any(body >= self.vocab_size)):
            raise ValueError("tokens must be <bos> followed by pass or square tokens only")
        moves = np.where(body == PASS_ID, PASS, body - SQUARE_OFFSET)
        return self._batch(play_moves(moves, size=self.board_size))

    def _tokens(self, moves: np.ndarray) -> np.ndarray:
        """int64 ``[n, T]`` token sequences of moves int8 ``[n, T - 1]`` (in blocks of rows: no full-size temporary)."""
        tokens = np.empty((len(moves), self.seq_len), dtype=np.int64)
        tokens[:, 0] = BOS_ID
        for lo in range(0, len(moves), 65536):
            m = moves[lo:lo + 65536]
            tokens[lo:lo + 65536, 1:] = np.where(m == PASS, PASS_ID, m.astype(np.int64) + SQUARE_OFFSET)
        return tokens

    def _loss_mask(self, n: int) -> np.ndarray:
        loss_mask = np.ones((n, self.seq_len), dtype=bool)
        loss_mask[:, -1] = False
        return loss_mask

    def _batch(self, games: OthelloGames) -> Batch:
        n, T, V, F, size = len(games), self.seq_len, self.vocab_size, self.n_features, self.board_size
        G = T - 1
        tokens, loss_mask = self._tokens(games.moves), self._loss_mask(n)

        start_legal = bitboard_to_mask(legal_moves(START_OWN, START_OPP, size=size), size=size)  # [F]
        legal = np.zeros((n, T, V), dtype=bool)
        legal[:, 0, SQUARE_OFFSET:] = start_legal
        legal[:, 1 : T - 1, SQUARE_OFFSET:] = games.legal[:, : G - 1]
        legal[:, 1 : T - 1, PASS_ID] = ~games.legal[:, : G - 1].any(axis=-1)

        features = np.empty((n, T, F), dtype=np.float32)
        start_board = (bitboard_to_mask(START_OWN, size=size).astype(np.float32)
                       - bitboard_to_mask(START_OPP, size=size))
        features[:, 0] = start_board
        features[:, 1:] = games.boards
        types = np.empty((n, T, F), dtype=np.int8)
        types[:, 0] = square_types(START_OWN, START_OPP, size=size)
        types[:, 1:] = games.types
        return Batch(tokens=tokens, loss_mask=loss_mask, legal=legal, features=features, feature_types=types)
