"""Plain per-game Othello engine, the baseline of ``bench_othello.py``.

Straightforward Python over a NumPy 8x8 board, one game, one square and one direction at a time, with square
types by flip-and-recompute; the conventions are those of ``ntpflow.tasks.othello_engine`` (standard
opening, 60 tokens, passes count, square ``8 * row + col``, pass = 64, states seen by the player to move
next), so its games can be replayed by ``othello_engine.play_moves`` and compared.
"""

from __future__ import annotations

import numpy as np

PASS = 64
GAME_LEN = 60
DIRECTIONS = ((-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1))


def start_board() -> np.ndarray:
    """int8 [8, 8] seen by the first mover: +1 on D5 and E4, -1 on D4 and E5."""
    board = np.zeros((8, 8), dtype=np.int8)
    board[3, 3] = board[4, 4] = -1
    board[4, 3] = board[3, 4] = 1
    return board


def captures(board: np.ndarray, r: int, c: int) -> list[tuple[int, int]]:
    """Opponent stones flipped by the player to move (+1) playing the empty square (r, c)."""
    out = []
    for dr, dc in DIRECTIONS:
        line = []
        i, j = r + dr, c + dc
        while 0 <= i < 8 and 0 <= j < 8 and board[i, j] == -1:
            line.append((i, j))
            i, j = i + dr, j + dc
        if line and 0 <= i < 8 and 0 <= j < 8 and board[i, j] == 1:
            out += line
    return out


def legal_squares(board: np.ndarray) -> list[int]:
    return [8 * r + c for r in range(8) for c in range(8) if board[r, c] == 0 and captures(board, r, c)]


def square_types(board: np.ndarray) -> np.ndarray:
    """int8 [64]: 0 empty, 2 if flipping the stone changes the legal moves, else 1."""
    base = legal_squares(board)
    out = np.zeros(64, dtype=np.int8)
    for r in range(8):
        for c in range(8):
            if board[r, c] != 0:
                flipped = board.copy()
                flipped[r, c] = -flipped[r, c]
                out[8 * r + c] = 2 if legal_squares(flipped) != base else 1
    return out


def play_game(rng: np.random.Generator, with_states: bool = True):
    """One random game: moves int [60] and, if ``with_states``, boards int8 [60, 64], legal bool [60, 64]
    and types int8 [60, 64] after each token (seen by the player to move next)."""
    board = start_board()
    moves = np.empty(GAME_LEN, dtype=np.int64)
    boards = np.empty((GAME_LEN, 64), dtype=np.int8)
    legal_mask = np.zeros((GAME_LEN, 64), dtype=bool)
    types = np.empty((GAME_LEN, 64), dtype=np.int8)
    legal = legal_squares(board)
    for t in range(GAME_LEN):
        if legal:
            move = legal[rng.integers(len(legal))]
            r, c = divmod(move, 8)
            for i, j in captures(board, r, c):
                board[i, j] = 1
            board[r, c] = 1
        else:
            move = PASS
        board = -board  # the other player is to move
        moves[t] = move
        legal = legal_squares(board)
        if with_states:
            boards[t] = board.reshape(64)
            legal_mask[t, legal] = True
            types[t] = square_types(board)
    if not with_states:
        return moves
    return moves, boards, legal_mask, types


def play_games(n: int, seed: int, with_states: bool = True):
    """``n`` games from ``seed``; stacked like :func:`play_game` with a leading ``[n]`` axis."""
    rng = np.random.default_rng(seed)
    games = [play_game(rng, with_states) for _ in range(n)]
    if not with_states:
        return np.stack(games)
    return tuple(np.stack(parts) for parts in zip(*games))
