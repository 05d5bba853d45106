"""Fast random Othello games on uint64 bitboards, vectorised over games with NumPy.

Board and squares
    Square ``s = 8 * row + col`` (``row``, ``col`` in ``0..7``) is bit ``s`` of a uint64 bitboard. Its name
    is the column letter and the row number, standard Othello notation with row 1 at the top:
    ``s = 0`` is ``A1``, ``s = 7`` is ``H1``, ``s = 63`` is ``H8`` (:data:`SQUARE_NAMES`).

Opening
    The standard one: white on D4 and E5, black on D5 and E4, black (the "first mover") to move, whose legal
    moves are D3, C4, F5 and E6. The reference code (Markfryazino/useless-features-iclr-code) puts the first
    mover's stones on D4/E5 instead, the mirror image of this one (row ``r`` <-> ``7 - r``); every statistic
    is the same by symmetry.

Games (as the reference code)
    A game is exactly :data:`GAME_LEN` = 60 tokens. Each token is a uniformly random legal move of the player
    to move or, when that player has no legal move, a pass (:data:`PASS` = 64): the turn goes to the opponent
    and nothing else changes. Passes count towards the 60 tokens, so a game with passes is cut after 60
    tokens (its last moves are not played). A game that ends early (neither player can move; board full or
    one colour gone) is padded with pass tokens up to 60; every padding token is a pass, and so is the only
    legal token there.

Per move ``t`` (``0..59``; the state *after* token ``t``), all seen by the player to move next, i.e. the one
who chooses token ``t + 1`` (after a pass, the opponent of the player who passed):
    * ``boards[:, t]``: int8 ``[64]``, +1 own stone, -1 opponent stone, 0 empty;
    * ``legal[:, t]``: bool ``[64]``, that player's legal moves (all False: the next token is a pass);
    * ``types[:, t]``: int8 ``[64]``, 0 empty; 2 useful: flipping that stone's colour changes the set of
      legal moves of that player; 1 useless otherwise (docs/paper.md#useful-useless, the reference's ``features_type``).

Randomness: every function takes an ``int`` seed or a ``np.random.Generator``. Games are generated in blocks
of :data:`BLOCK` games; each block draws ``rng.random(block_size)`` once per token (60 draws, passes included)
and token ``t`` of game ``i`` is legal move number ``floor(u * n_legal)`` in increasing square order.
:func:`random_moves` and :func:`random_games` give the same moves for the same seed and ``n``.

Speed: every step is a fixed sequence of NumPy ufuncs over uint64 arrays of games (Python loops only over
tokens, the 8 directions and blocks). Square types use no loop over squares either: flipping stone ``q``
can only change the legality of the first empty square ``e`` found from ``q`` in each direction through
stones, and only through ``e``'s ray towards ``q``; :func:`useful_squares` evaluates that rule for all
stones at once with occluded fills (see its docstring).

Board sizes (:data:`BOARD_SIZES`: 8, the default, and 6, a fallback that is NOT the paper's setting)
    A 6×6 board is the inner 6×6 of the 8×8 bitboard (rows 2..7, columns B..G): every function takes
    ``size``, and at ``size=6`` the empty squares are masked to that region, so no move lands on the outer
    ring and no ray crosses it (a ring square is neither a stone nor empty: it acts as the edge). The four
    opening stones are the centre of both boards. Bitboards keep the 8×8 bit layout at every size; squares
    in ``moves``, masks, boards and types are the board's own, ``s = size * row + col`` over its ``size``
    rows and columns, named by their names on the 8×8 board (:class:`Board`; 6×6: ``B2`` = 0 .. ``G7`` =
    35). :data:`PASS` is 64 at every size. A 6×6 game is :attr:`Board.game_len` = 32 tokens, with the
    same pass and padding rules; the square types follow the same definition on the 6×6 board.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

__all__ = [
    "BLOCK",
    "BOARD_SIZES",
    "GAME_LEN",
    "PASS",
    "SQUARE_NAMES",
    "START_OPP",
    "START_OWN",
    "Board",
    "OthelloGames",
    "as_generator",
    "bitboard_to_mask",
    "board",
    "legal_moves",
    "mask_to_bitboard",
    "play",
    "play_moves",
    "random_games",
    "random_moves",
    "square_types",
    "start_position",
    "useful_squares",
]

GAME_LEN = 60  #: tokens per game on the 8×8 board, passes included (6×6: ``board(6).game_len`` = 32)
PASS = 64  #: the pass move in ``moves`` arrays, at every board size (squares are 0..63 on 8×8, 0..35 on 6×6)
BLOCK = 4096  #: games generated per vectorised block (fixes the random stream, see module docstring)

SQUARE_NAMES: tuple[str, ...] = tuple(f"{'ABCDEFGH'[s % 8]}{s // 8 + 1}" for s in range(64))
BOARD_SIZES = (8, 6)  #: the board sizes: 8 (the paper's) and 6 (the fallback, not the paper's setting)


@dataclass(frozen=True)
class Board:
    """The geometry of one board size (module docstring): its squares inside the 8×8 bitboard.

    Attributes:
        size: 8 or 6 (rows = columns).
        game_len: tokens per game, passes included (``size ** 2 - 4``: 60 or 32).
        names: ``size ** 2`` square names, by square (their names on the 8×8 board).
        bits: int64 ``[size ** 2]``: the 8×8 bit of each square.
        region: uint64 bitboard of the board's squares (all 64 bits at size 8).
        square_of_bit: int64 ``[65]``: the square of each 8×8 bit (-1 off the board); ``[64] = PASS``.
    """

    size: int
    game_len: int
    names: tuple[str, ...]
    bits: np.ndarray
    region: np.uint64
    square_of_bit: np.ndarray

    @property
    def n_squares(self) -> int:
        """``size ** 2``."""
        return self.size * self.size


def _make_board(size: int) -> Board:
    lo = (8 - size) // 2
    bits = np.array([8 * r + c for r in range(lo, lo + size) for c in range(lo, lo + size)], dtype=np.int64)
    square_of_bit = np.full(65, -1, dtype=np.int64)
    square_of_bit[bits] = np.arange(size * size)
    square_of_bit[64] = 64  # PASS
    region = np.uint64(sum(1 << int(b) for b in bits))
    return Board(size=size, game_len=size * size - 4, names=tuple(SQUARE_NAMES[b] for b in bits), bits=bits,
                 region=region, square_of_bit=square_of_bit)


_BOARDS = {n: _make_board(n) for n in BOARD_SIZES}


def board(size: int = 8) -> Board:
    """The :class:`Board` of ``size`` (6 or 8); ValueError for any other."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or int(size) not in _BOARDS:
        raise ValueError(f"board size must be 6 or 8, got {size!r}")
    return _BOARDS[int(size)]


def _bit(name: str) -> int:
    return 1 << SQUARE_NAMES.index(name)


#: bitboard of the first mover's stones at the start (black: D5, E4)
START_OWN = np.uint64(_bit("D5") | _bit("E4"))
#: bitboard of the opponent's stones at the start (white: D4, E5)
START_OPP = np.uint64(_bit("D4") | _bit("E5"))

_U = np.uint64
_ZERO = _U(0)
_ONE = _U(1)
_ALL = _U(0xFFFF_FFFF_FFFF_FFFF)
_NOT_A = _U(0xFEFE_FEFE_FEFE_FEFE)  # column A cleared
_NOT_H = _U(0x7F7F_7F7F_7F7F_7F7F)  # column H cleared

# Directions k = 0..7 as (bit shift, shift left?, mask of valid destinations). A step to col + 1 that starts
# on column H wraps onto column A of another row, so it is masked with _NOT_A (and col - 1 with _NOT_H).
# Opposite directions are k and k ^ 4.
# Order: E (col+1), S (row+1), SE, SW, W (col-1), N (row-1), NW, NE.
_SHIFT = (_U(1), _U(8), _U(9), _U(7), _U(1), _U(8), _U(9), _U(7))
_SHIFT_N = {(k, n): _U(int(_SHIFT[k]) * n) for k in range(8) for n in (1, 2, 4)}
_LEFT = (True, True, True, True, False, False, False, False)
_DST = (_NOT_A, _ALL, _NOT_A, _NOT_H, _NOT_H, _ALL, _NOT_H, _NOT_A)
_DIRS = range(8)


def _sh(x: np.ndarray, k: int, n: int = 1) -> np.ndarray:
    """Shift bitboards ``n`` steps in direction ``k`` (unmasked: the caller masks wrapped bits)."""
    s = _SHIFT_N[k, n]
    return np.left_shift(x, s) if _LEFT[k] else np.right_shift(x, s)


def _fill(gen: np.ndarray, pro: np.ndarray, k: int) -> np.ndarray:
    """Occluded fill: ``gen`` plus every square reached from it by steps in direction ``k`` through ``pro``.

    ``pro`` must already be masked with ``_DST[k]`` (Kogge-Stone, reaches up to 7 steps).
    """
    gen = gen | (pro & _sh(gen, k, 1))
    pro = pro & _sh(pro, k, 1)
    gen |= pro & _sh(gen, k, 2)
    pro &= _sh(pro, k, 2)
    gen |= pro & _sh(gen, k, 4)
    return gen


def _legal_by_dir(own: np.ndarray, opp: np.ndarray, empty: np.ndarray, k: int) -> np.ndarray:
    """Empty squares reached from an own stone by >= 1 opponent stones in direction ``k``."""
    run = _fill(own, opp & _DST[k], k) ^ own  # opponent stones in runs that start next to an own stone
    return _sh(run, k) & empty & _DST[k]


def _as_bitboards(own, opp, b: Board | None = None) -> tuple[np.ndarray, np.ndarray]:
    own = np.asarray(own)
    opp = np.asarray(opp)
    if own.dtype != np.uint64 or opp.dtype != np.uint64:
        raise ValueError(f"bitboards must be uint64, got {own.dtype} and {opp.dtype}")
    if own.shape != opp.shape:
        raise ValueError(f"own and opp shapes differ: {own.shape} vs {opp.shape}")
    if np.any(own & opp):
        raise ValueError("own and opp bitboards overlap")
    if b is not None and b.size != 8 and np.any((own | opp) & ~b.region):
        raise ValueError(f"stones outside the {b.size}x{b.size} board")
    return own, opp


def legal_moves(own, opp, *, size: int = 8) -> np.ndarray:
    """Legal moves of the player owning ``own`` on the board of ``size`` (6 or 8).

    Args:
        own, opp: uint64 bitboards of any (equal) shape ``[...]``, the player to move's stones and the other's.
    Returns:
        uint64 ``[...]`` bitboard of legal moves (0: the player must pass).
    """
    b = board(size)
    own, opp = _as_bitboards(own, opp, b)
    return _legal(own, opp, b)


def _empty(own: np.ndarray, opp: np.ndarray, b: Board | None) -> np.ndarray:
    """The empty squares of the board (at size 6 the outer ring is never empty)."""
    empty = ~(own | opp)
    return empty if b is None or b.size == 8 else empty & b.region


def _legal(own: np.ndarray, opp: np.ndarray, b: Board | None = None) -> np.ndarray:
    empty = _empty(own, opp, b)
    out = np.zeros(own.shape, dtype=np.uint64)
    for k in _DIRS:
        out |= _legal_by_dir(own, opp, empty, k)
    return out


def _flips(own: np.ndarray, opp: np.ndarray, move: np.ndarray) -> np.ndarray:
    """Opponent stones flipped by ``move`` (a one-bit bitboard, or 0 for a pass; may include ``move``)."""
    out = np.zeros(own.shape, dtype=np.uint64)
    for k in _DIRS:
        run = _fill(move, opp & _DST[k], k)  # move plus the opponent run that follows it
        capped = (_sh(run, k) & own & _DST[k]) != 0  # an own stone right after the run
        out |= np.where(capped, run, _ZERO)
    return out


def play(own, opp, square, *, size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Play ``square`` (int ``[...]``, a square ``0..size**2-1`` of the board, or :data:`PASS`) for the player owning
    ``own`` on the board of ``size`` (6 or 8).

    Returns the ``(own, opp)`` uint64 bitboards ``[...]`` after the move, seen by the player to move next (the
    opponent). Raises ``ValueError`` on an illegal move, or a pass while a move is legal.
    """
    b = board(size)
    own, opp = _as_bitboards(own, opp, b)
    square = np.asarray(square)
    if square.shape != own.shape or not np.issubdtype(square.dtype, np.integer):
        raise ValueError(f"square must be an integer array of the bitboards' shape {own.shape}")
    if square.size and (square.min() < 0 or square.max() > PASS or np.any((square >= b.n_squares) & (square != PASS))):
        raise ValueError(f"squares must be 0..{b.n_squares - 1} or PASS ({PASS})")
    legal = _legal(own, opp, b)
    move = _square_bits(_to_bit(square, b))
    if np.any(np.where(square == PASS, legal != 0, (move & legal) == 0)):
        raise ValueError("illegal move (or a pass while a move is legal)")
    flips = _flips(own, opp, move)
    return opp & ~flips, own | flips | move


def useful_squares(own, opp, *, size: int = 8) -> np.ndarray:
    """Stones whose colour flip changes the legal-move set of the player owning ``own`` (type 2) on the board of
    ``size`` (6 or 8).

    Args:
        own, opp: uint64 bitboards of any (equal) shape ``[...]``; ``own`` is the player to move.
    Returns:
        uint64 ``[...]`` bitboard of useful stones (a subset of ``own | opp``).

    Rule used (equivalent to flip-and-recompute, checked against it in tests): flipping stone ``q`` changes
    only the ray, towards ``q``, of the first empty square ``e`` met from ``q`` in each direction through
    stones. Along that ray ``e`` sees a run of stones ``c1, c2, ...`` (up to an empty square or the edge) and
    is legal through it iff ``c1`` is an opponent stone and the run holds an own stone. With ``K`` the number
    of own stones in the run, flipping ``c_j`` changes that iff: ``j = 1`` and (``c1`` opponent and
    ``K >= 1``, or ``c1`` own and ``K >= 2``); or ``j >= 2``, ``c1`` opponent and (``c_j`` own and ``K = 1``,
    or ``c_j`` opponent and ``K = 0``). The legal set changes iff, in addition, ``e`` is not legal through one
    of its 7 other rays. At size 6 a ring square ends a run as the edge does (it is neither stone nor empty).
    """
    b = board(size)
    own, opp = _as_bitboards(own, opp, b)
    return _useful(own, opp, b)


def _useful(own: np.ndarray, opp: np.ndarray, b: Board | None = None) -> np.ndarray:
    occ = own | opp
    empty = _empty(own, opp, b)
    # ray[k]: empty squares legal through their ray in direction k (reached from an own stone going k ^ 4)
    ray = [_legal_by_dir(own, opp, empty, k ^ 4) for k in _DIRS]
    once = np.zeros(own.shape, dtype=np.uint64)
    twice = np.zeros(own.shape, dtype=np.uint64)
    for k in _DIRS:
        twice |= once & ray[k]
        once |= ray[k]
    out = np.zeros(own.shape, dtype=np.uint64)
    for k in _DIRS:  # e looks in direction k; back = k ^ 4 goes back towards e
        back = k ^ 4
        active = empty & ~(twice | (once & ~ray[k]))  # empties not legal through another ray
        first = _sh(active, k) & occ & _DST[k]  # c1 of every active empty's run
        pro_b = occ & _DST[back]
        k1 = _fill(own, pro_b, back)  # an own stone here or further along the run (K >= 1 from here)
        k2 = _fill(own & _sh(k1, back) & _DST[back], pro_b, back)  # at least two (K >= 2 from here)
        lead = _fill(first & opp, opp & _DST[k], k)  # the leading opponent stones of runs with c1 opponent
        out |= first & ((opp & k1) | (own & k2))  # j = 1
        out |= _sh(lead, k) & _DST[k] & own & ~k2  # j >= 2: the run's only own stone (K = 1)
        out |= lead & ~first & ~k1  # j >= 2 in an all-opponent run (K = 0)
    return out


def square_types(own, opp, *, size: int = 8) -> np.ndarray:
    """Square types of positions: 0 empty, 1 useless stone, 2 useful stone (see :func:`useful_squares`).

    Args:
        own, opp: uint64 bitboards of shape ``[...]``; ``own`` is the player to move.
        size: the board size (6 or 8).
    Returns:
        int8 ``[..., size**2]`` indexed by square.
    """
    b = board(size)
    own, opp = _as_bitboards(own, opp, b)
    useful = _useful(own, opp, b)
    return _on_board((_unpack(own | opp) + _unpack(useful)).view(np.int8), b)


def _on_board(x: np.ndarray, b: Board) -> np.ndarray:
    """``x[..., 64]`` indexed by 8×8 bit -> ``[..., size**2]`` indexed by the board's squares."""
    return x if b.size == 8 else x[..., b.bits]


def _to_bit(square: np.ndarray, b: Board) -> np.ndarray:
    """The board's squares (or PASS) -> their 8×8 bits (or PASS), same shape."""
    return square if b.size == 8 else np.where(square == PASS, PASS, b.bits[np.where(square == PASS, 0, square)])


def _unpack(x: np.ndarray) -> np.ndarray:
    """uint64 ``[...]`` -> uint8 0/1 ``[..., 64]`` with index = square."""
    shape = np.shape(x)
    flat = np.ascontiguousarray(x, dtype="<u8").reshape(-1)
    return np.unpackbits(flat.view(np.uint8).reshape(*shape, 8), axis=-1, bitorder="little")


def bitboard_to_mask(x, *, size: int = 8) -> np.ndarray:
    """uint64 bitboards ``[...]`` -> bool ``[..., size**2]`` indexed by the board's squares (``size`` 6 or 8)."""
    b = board(size)
    x = np.asarray(x)
    if x.dtype != np.uint64:
        raise ValueError(f"bitboards must be uint64, got {x.dtype}")
    if b.size != 8 and np.any(x & ~b.region):
        raise ValueError(f"bits outside the {b.size}x{b.size} board")
    return _on_board(_unpack(x), b).view(bool)


def mask_to_bitboard(mask, *, size: int = 8) -> np.ndarray:
    """bool ``[..., size**2]`` indexed by the board's squares -> uint64 bitboards ``[...]`` (``size`` 6 or 8)."""
    b = board(size)
    mask = np.asarray(mask)
    if mask.ndim < 1 or mask.shape[-1] != b.n_squares:
        raise ValueError(f"mask must have a last axis of {b.n_squares} squares, got shape {mask.shape}")
    if b.size != 8:
        full = np.zeros((*mask.shape[:-1], 64), dtype=bool)
        full[..., b.bits] = mask
        mask = full
    packed = np.packbits(mask.astype(bool), axis=-1, bitorder="little")  # [..., 8]
    return np.ascontiguousarray(packed).view("<u8")[..., 0].astype(np.uint64)


def start_position() -> tuple[np.uint64, np.uint64]:
    """``(own, opp)`` bitboards of the opening, seen by the first mover (black)."""
    return START_OWN, START_OPP


def as_generator(seed) -> np.random.Generator:
    """An ``np.random.Generator`` from an ``int`` seed (>= 0) or a Generator (returned as is)."""
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0:
        return np.random.default_rng(int(seed))
    raise ValueError(f"seed must be a non-negative int or a numpy Generator, got {seed!r}")


def _check_n(n) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    return int(n)


# --------------------------------------------------------------------------------------------------------
# Games
# --------------------------------------------------------------------------------------------------------

_LOW = {w: _U((1 << w) - 1) for w in (32, 16, 8, 4, 2, 1)}


def _choose(legal: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Square of legal move number ``floor(u * n_legal)`` (increasing square order), PASS if none.

    legal: uint64 ``[n]``; u: float64 ``[n]`` in [0, 1). Returns uint8 ``[n]``.
    """
    count = np.bitwise_count(legal)
    rank = (u * count).astype(np.uint8)  # < count when count > 0
    x = legal
    square = np.zeros(legal.shape, dtype=np.uint8)
    for w in (32, 16, 8, 4, 2, 1):  # binary search for the rank-th set bit of the window [square, square+2w)
        c = np.bitwise_count(x & _LOW[w])  # set bits in the window's lower half
        amount = (rank >= c) * np.uint8(w)  # w if the wanted bit is in the upper half
        rank -= c * (amount != 0)
        x = x >> amount  # bits above the window are never counted again
        square += amount
    square[count == 0] = PASS
    return square


def _square_bits(square: np.ndarray) -> np.ndarray:
    """int ``[n]`` squares (PASS allowed) -> uint64 one-bit bitboards (0 for PASS)."""
    is_move = square != PASS
    return np.where(is_move, np.left_shift(_ONE, np.where(is_move, square, 0).astype(np.uint64)), _ZERO)


@dataclass(frozen=True)
class OthelloGames:
    """``N`` games of ``G`` tokens on a board of ``S`` squares (module docstring for all conventions; 8×8: ``G = 60``,
    ``S = 64``; 6×6: ``G = 32``, ``S = 36``).

    Attributes:
        moves: int8 ``[N, G]``; square ``0..S-1`` of token ``t``, or :data:`PASS` (64).
        boards: int8 ``[N, G, S]``; board after token ``t``, seen by the player to move next
            (+1 own, -1 opponent, 0 empty).
        legal: bool ``[N, G, S]``; legal moves after token ``t`` (of token ``t + 1``); all False = pass.
        types: int8 ``[N, G, S]``; 0 empty, 1 useless, 2 useful, for the position after token ``t``.
        own, opp: uint64 ``[N, G]``; bitboards (8×8 bit layout) after token ``t`` of the player to move next and of
            the other.
        size: the board size (8 or 6).
    """

    moves: np.ndarray
    boards: np.ndarray
    legal: np.ndarray
    types: np.ndarray
    own: np.ndarray
    opp: np.ndarray
    size: int = 8

    def __len__(self) -> int:
        return int(self.moves.shape[0])

    def __getitem__(self, idx) -> OthelloGames:
        """Select games (slice, integer or boolean array; an int gives one game, kept as ``N = 1``)."""
        if isinstance(idx, (int, np.integer)):
            idx = [int(idx)]
        return OthelloGames(**{f: getattr(self, f)[idx] for f in self.__dataclass_fields__ if f != "size"},
                            size=self.size)


def _play_block(n: int, rng: np.random.Generator | None, given: np.ndarray | None, record: bool, b: Board):
    """Play one block of ``n`` games; moves drawn from ``rng`` or replayed from ``given`` int ``[n, G]`` (8×8 bits).

    Returns moves int8 ``[n, G]`` (8×8 bits or PASS) and, if ``record``, own/opp/legal uint64 ``[G, n]`` after each
    token.
    """
    G = b.game_len
    own = np.full(n, START_OWN, dtype=np.uint64)
    opp = np.full(n, START_OPP, dtype=np.uint64)
    moves = np.empty((G, n), dtype=np.int8)
    rec = np.empty((3, G, n), dtype=np.uint64) if record else None
    legal = _legal(own, opp, b)
    for t in range(G):
        if given is None:
            assert rng is not None  # moves are drawn where none are given
            square = _choose(legal, rng.random(n))
            move = _square_bits(square)
        else:
            square = given[:, t]
            move = _square_bits(square)
            bad = np.where(square == PASS, legal != 0, (move & legal) == 0)
            if np.any(bad):
                i = int(np.argmax(bad))
                raise ValueError(f"illegal move {int(b.square_of_bit[square[i]])} at token {t} of game {i}")
        flips = _flips(own, opp, move)
        own, opp = opp & ~flips, own | flips | move  # the opponent is to move next
        moves[t] = square
        if record or t + 1 < G:
            legal = _legal(own, opp, b)
        if rec is not None:  # record
            rec[0, t], rec[1, t], rec[2, t] = own, opp, legal
    return moves.T, rec


@overload
def _run(n: int, rng, given, record: Literal[False], b: Board) -> np.ndarray: ...
@overload
def _run(n: int, rng, given, record: Literal[True], b: Board) -> OthelloGames: ...
def _run(n: int, rng, given, record: bool, b: Board) -> np.ndarray | OthelloGames:
    G = b.game_len
    blocks = [(i, min(n, i + BLOCK)) for i in range(0, n, BLOCK)]
    moves = np.empty((n, G), dtype=np.int8)
    if not record:
        for lo, hi in blocks:
            moves[lo:hi] = _play_block(hi - lo, rng, None if given is None else given[lo:hi], False, b)[0]
        return _moves_on_board(moves, b)
    own = np.empty((n, G), dtype=np.uint64)
    opp = np.empty_like(own)
    boards = np.empty((n, G, b.n_squares), dtype=np.int8)
    legal = np.empty((n, G, b.n_squares), dtype=bool)
    types = np.empty((n, G, b.n_squares), dtype=np.int8)
    for lo, hi in blocks:
        m, rec = _play_block(hi - lo, rng, None if given is None else given[lo:hi], True, b)
        assert rec is not None  # recorded
        moves[lo:hi] = m
        o, p, lg = (np.ascontiguousarray(r.T) for r in rec)  # [blk, G]
        own[lo:hi], opp[lo:hi] = o, p
        ob, pb = _on_board(_unpack(o), b), _on_board(_unpack(p), b)
        boards[lo:hi] = ob.view(np.int8) - pb.view(np.int8)
        legal[lo:hi] = _on_board(_unpack(lg), b).view(bool)
        types[lo:hi] = (ob + pb + _on_board(_unpack(_useful(o, p, b)), b)).view(np.int8)
    return OthelloGames(moves=_moves_on_board(moves, b), boards=boards, legal=legal, types=types, own=own, opp=opp,
                        size=b.size)


def _moves_on_board(moves: np.ndarray, b: Board) -> np.ndarray:
    """int8 moves as 8×8 bits (or PASS) -> the board's squares (or PASS), in place of a copy at size 6."""
    return moves if b.size == 8 else b.square_of_bit[moves].astype(np.int8)


def random_moves(n: int, seed, *, size: int = 8) -> np.ndarray:
    """Moves only (fast path): int8 ``[n, G]`` squares ``0..size**2-1`` or :data:`PASS` of ``n`` random games on the
    board of ``size`` (6 or 8; ``G`` = 60 or 32 tokens).

    ``seed``: ``int`` or ``np.random.Generator``. Same moves as ``random_games(n, seed, size=size).moves``.
    """
    b = board(size)
    n = _check_n(n)
    return _run(n, as_generator(seed), None, False, b)


def random_games(n: int, seed, *, size: int = 8) -> OthelloGames:
    """``n`` random legal games with boards, legal masks and square types (:class:`OthelloGames`) on the board of
    ``size`` (6 or 8).

    ``seed``: ``int`` or ``np.random.Generator`` (the only source of randomness).
    """
    b = board(size)
    n = _check_n(n)
    return _run(n, as_generator(seed), None, True, b)


def play_moves(moves, *, size: int = 8) -> OthelloGames:
    """Replay given games: ``moves`` int ``[N, G]`` (the board's squares or :data:`PASS`; ``G`` = 60 at size 8, 32 at
    size 6) -> :class:`OthelloGames`.

    Raises ``ValueError`` on an illegal move, a pass while a move is legal, or a move while none is.
    """
    b = board(size)
    G = b.game_len
    moves = np.asarray(moves)
    if moves.ndim != 2 or moves.shape[1] != G or not np.issubdtype(moves.dtype, np.integer):
        raise ValueError(f"moves must be an integer array of shape [N, {G}], got {moves.dtype} {moves.shape}")
    if moves.size and (moves.min() < 0 or moves.max() > PASS or np.any((moves >= b.n_squares) & (moves != PASS))):
        raise ValueError(f"moves must be squares 0..{b.n_squares - 1} or PASS ({PASS})")
    return _run(moves.shape[0], None, _to_bit(moves.astype(np.int64), b), True, b)
