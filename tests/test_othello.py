"""Tests for the Othello engine (ntpflow.tasks.othello_engine) and task (ntpflow.tasks.othello).

The engine is checked against an independent, deliberately simple engine written below: plain Python, one
square and one direction at a time, absolute colours, no bitboards.
"""

from __future__ import annotations

import numpy as np
import pytest

from ntpflow.tasks import TASKS, Batch, Task, make_task
from ntpflow.tasks.othello import PASS_ID, SQUARE_OFFSET, Othello
from ntpflow.tasks.othello_engine import (
    BLOCK,
    GAME_LEN,
    PASS,
    SQUARE_NAMES,
    START_OPP,
    START_OWN,
    bitboard_to_mask,
    legal_moves,
    mask_to_bitboard,
    play_moves,
    random_games,
    random_moves,
    square_types,
    useful_squares,
)

# ---------------------------------------------------------------------------------------------------------
# Independent simple engine. Board: list of 64 ints, +1 black, -1 white, 0 empty; square = 8 * row + col.
# ---------------------------------------------------------------------------------------------------------

BLACK, WHITE = 1, -1
DIRECTIONS = [(-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1)]
# RAYS[sq] = for each direction, the squares met walking from sq to the edge
RAYS = [
    [
        [8 * (r + i * dr) + (c + i * dc) for i in range(1, 8) if 0 <= r + i * dr < 8 and 0 <= c + i * dc < 8]
        for dr, dc in DIRECTIONS
    ]
    for r in range(8)
    for c in range(8)
]


def sq(name: str) -> int:
    """'D3' -> 8 * (3 - 1) + 3."""
    return 8 * (int(name[1]) - 1) + "ABCDEFGH".index(name[0])


def ref_start() -> list[int]:
    board = [0] * 64
    board[sq("D4")] = board[sq("E5")] = WHITE
    board[sq("D5")] = board[sq("E4")] = BLACK
    return board


def ref_flips(board: list[int], square: int, me: int) -> list[int]:
    """Stones flipped if `me` plays on the empty `square` (empty list: not a legal move)."""
    flipped = []
    for ray in RAYS[square]:
        line = []
        for s in ray:
            if board[s] == -me:
                line.append(s)
                continue
            if board[s] == me:
                flipped += line
            break
    return flipped


def ref_legal(board: list[int], me: int) -> set[int]:
    return {s for s in range(64) if board[s] == 0 and ref_flips(board, s, me)}


def ref_types(board: list[int], me: int) -> list[int]:
    """0 empty; 2 if flipping the stone's colour changes `me`'s legal moves; 1 otherwise."""
    base = ref_legal(board, me)
    types = []
    for s in range(64):
        if board[s] == 0:
            types.append(0)
            continue
        flipped = list(board)
        flipped[s] = -flipped[s]
        types.append(2 if ref_legal(flipped, me) != base else 1)
    return types


def bits(squares) -> np.uint64:
    out = 0
    for s in squares:
        out |= 1 << (sq(s) if isinstance(s, str) else s)
    return np.uint64(out)


def mask_squares(mask) -> set[int]:
    return {int(s) for s in np.flatnonzero(mask)}


def replay_and_compare(games, type_tokens=None) -> dict:
    """Replay every game with the simple engine and compare token by token.

    ``type_tokens``: None (check no types), "all", or an int array [N] of one token index per game.
    Returns counters (mid-game passes, finished games) for coverage checks.
    """
    stats = {"mid_passes": 0, "finished": 0, "type_checks": 0}
    for i in range(len(games)):
        board, me = ref_start(), BLACK
        legal = ref_legal(board, me)
        over = False
        for t in range(GAME_LEN):
            move = int(games.moves[i, t])
            if not legal:
                assert move == PASS, (i, t)
                if not ref_legal(board, -me):
                    over = True
                elif not over:
                    stats["mid_passes"] += 1
            else:
                assert not over
                assert move in legal, (i, t)
                flips = ref_flips(board, move, me)
                board[move] = me
                for s in flips:
                    board[s] = me
            me = -me
            # state after token t, seen by `me` (the player to move next)
            assert games.boards[i, t].tolist() == [v * me for v in board], (i, t)
            legal = ref_legal(board, me)
            assert mask_squares(games.legal[i, t]) == legal, (i, t)
            if type_tokens is not None and (isinstance(type_tokens, str) or type_tokens[i] == t):
                assert games.types[i, t].tolist() == ref_types(board, me), (i, t)
                stats["type_checks"] += 1
        stats["finished"] += over
    return stats


# ---------------------------------------------------------------------------------------------------------
# Hand-checked positions
# ---------------------------------------------------------------------------------------------------------


def test_square_names_and_opening():
    assert SQUARE_NAMES[0] == "A1" and SQUARE_NAMES[7] == "H1" and SQUARE_NAMES[63] == "H8"
    assert sq("D3") == 19
    assert START_OWN == bits(["D5", "E4"]) and START_OPP == bits(["D4", "E5"])
    legal = legal_moves(START_OWN, START_OPP)
    assert {SQUARE_NAMES[s] for s in mask_squares(bitboard_to_mask(legal))} == {"D3", "C4", "F5", "E6"}
    # flipping any centre stone changes the legal set, e.g. D4 -> own: {E6, F5, F6}
    types = square_types(START_OWN, START_OPP)
    assert {SQUARE_NAMES[s]: int(types[s]) for s in np.flatnonzero(types)} == {"D4": 2, "E4": 2, "D5": 2, "E5": 2}
    flipped = legal_moves(START_OWN | bits(["D4"]), START_OPP & ~bits(["D4"]))
    assert {SQUARE_NAMES[s] for s in mask_squares(bitboard_to_mask(flipped))} == {"E6", "F5", "F6"}


def test_first_move_d3_then_white_replies():
    moves = np.full((1, GAME_LEN), PASS, dtype=np.int64)
    moves[0, 0] = sq("D3")
    with pytest.raises(ValueError, match="illegal move"):  # the game cannot pass after D3
        play_moves(moves)
    g = random_games(200, 3)
    i = int(np.flatnonzero(g.moves[:, 0] == sq("D3"))[0])
    # black D3 flips D4; white (to move) sees black's stones as -1
    expected = np.zeros(64, dtype=np.int8)
    expected[[sq("D3"), sq("D4"), sq("D5"), sq("E4")]] = -1
    expected[sq("E5")] = 1
    np.testing.assert_array_equal(g.boards[i, 0], expected)
    assert {SQUARE_NAMES[s] for s in mask_squares(g.legal[i, 0])} == {"C3", "E3", "C5"}


def test_known_pass_position():
    # A1 white, B1 black, black to move: B1's only opponent neighbour A1 sits on the edge -> black passes,
    # white then has C1 (capturing B1 against A1).
    own, opp = bits(["B1"]), bits(["A1"])
    assert legal_moves(own, opp) == 0
    assert mask_squares(bitboard_to_mask(legal_moves(opp, own))) == {sq("C1")}
    board = [0] * 64
    board[sq("A1")], board[sq("B1")] = WHITE, BLACK
    assert ref_legal(board, BLACK) == set() and ref_legal(board, WHITE) == {sq("C1")}


def test_square_types_worked_by_hand():
    # own A1, opponent B1 C1; legal {D1} through D1's west ray C1 B1 A1.
    #   A1: -> no own stone left, legal {} : useful
    #   B1: -> A1 B1 own, C1 opp: D1 still legal : useless
    #   C1: -> own, D1 sees an own stone first : useful
    own, opp = bits(["A1"]), bits(["B1", "C1"])
    assert mask_squares(bitboard_to_mask(legal_moves(own, opp))) == {sq("D1")}
    types = square_types(own, opp)
    assert {SQUARE_NAMES[s]: int(types[s]) for s in np.flatnonzero(types)} == {"A1": 2, "B1": 1, "C1": 2}
    # add own D3, opponent D2: D1 is also legal through its south ray (D2 D3), so it stays legal whatever
    # happens on its west ray: A1 and B1 become useless. C1 -> own makes E3 legal (E3 D2 C1 diagonal):
    # useful. D2 -> own: D1 still legal via the west ray, nothing new: useless. D3 -> opponent: D1 still
    # legal via the west ray: useless.
    own, opp = bits(["A1", "D3"]), bits(["B1", "C1", "D2"])
    assert mask_squares(bitboard_to_mask(legal_moves(own, opp))) == {sq("D1")}
    types = square_types(own, opp)
    expected = {"A1": 1, "B1": 1, "C1": 2, "D2": 1, "D3": 1}
    assert {SQUARE_NAMES[s]: int(types[s]) for s in np.flatnonzero(types)} == expected
    # the simple engine agrees
    board = [0] * 64
    for name, v in [("A1", 1), ("D3", 1), ("B1", -1), ("C1", -1), ("D2", -1)]:
        board[sq(name)] = v
    assert ref_types(board, 1) == types.tolist()


# ---------------------------------------------------------------------------------------------------------
# Agreement with the simple engine on random games
# ---------------------------------------------------------------------------------------------------------


def test_random_games_agree_with_simple_engine():
    games = random_games(2000, 2024)
    stats = replay_and_compare(games)
    assert stats["mid_passes"] > 0 and stats["finished"] > 0  # passes and finished games are covered


def test_square_types_agree_with_simple_engine():
    games = random_games(250, 7)
    full = replay_and_compare(games[:6], type_tokens="all")
    assert full["type_checks"] == 6 * GAME_LEN
    token = np.random.default_rng(0).integers(0, GAME_LEN, size=250)
    assert replay_and_compare(games, type_tokens=token)["type_checks"] == 250


def test_useful_squares_brute_force_random_positions():
    """Flip-and-recompute (with legal_moves, itself checked above) on arbitrary, non-game positions."""
    rng = np.random.default_rng(1)
    n = 3000
    density = rng.random((n, 1))
    occupied = rng.random((n, 64)) < density
    colour = rng.random((n, 64)) < 0.5
    own = mask_to_bitboard(occupied & colour)
    opp = mask_to_bitboard(occupied & ~colour)
    base = legal_moves(own, opp)
    one = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))  # [64]
    occ = (own | opp)[:, None]
    flip = (occ & one) != 0  # [n, 64]
    new_own = np.where((own[:, None] & one) != 0, own[:, None] & ~one, own[:, None] | (one & occ))
    new_opp = np.where((opp[:, None] & one) != 0, opp[:, None] & ~one, opp[:, None] | (one & occ))
    changed = (legal_moves(new_own, new_opp) != base[:, None]) & flip
    np.testing.assert_array_equal(bitboard_to_mask(useful_squares(own, opp)), changed)
    types = square_types(own, opp)
    np.testing.assert_array_equal(types, np.where(flip, 1 + changed, 0).astype(np.int8))


def test_moves_are_uniform_among_legal_moves():
    games = random_games(2000, 11)
    first = np.bincount(games.moves[:, 0], minlength=65)
    assert sorted(np.flatnonzero(first)) == sorted(sq(s) for s in ("D3", "C4", "F5", "E6"))
    assert np.all(np.abs(first[first > 0] - 500) < 100)  # sd ~19
    # pooled over all tokens: the rank of the chosen move among the k legal ones is uniform
    legal = games.legal[:, :-1]  # legal set of token t + 1
    nxt = games.moves[:, 1:]
    has = nxt != PASS
    k = legal.sum(-1)[has]
    chosen = np.take_along_axis(legal.cumsum(-1), np.where(has, nxt, 0)[..., None].astype(np.int64), -1)[..., 0]
    u = (chosen[has] - 0.5) / k  # uniform on (0, 1) in the mean
    assert abs(u.mean() - 0.5) < 0.01


def test_moves_only_path_and_replay_match():
    games = random_games(300, 5)
    np.testing.assert_array_equal(random_moves(300, 5), games.moves)
    np.testing.assert_array_equal(random_moves(300, np.random.default_rng(5)), games.moves)
    again = play_moves(games.moves)
    for f in ("moves", "boards", "legal", "types", "own", "opp"):
        np.testing.assert_array_equal(getattr(again, f), getattr(games, f))
    # consistency of the outputs with each other
    np.testing.assert_array_equal(games.boards, bitboard_to_mask(games.own).astype(np.int8) - bitboard_to_mask(games.opp))
    np.testing.assert_array_equal(games.types == 0, games.boards == 0)
    np.testing.assert_array_equal(games.legal, bitboard_to_mask(legal_moves(games.own, games.opp)))
    assert games.moves.dtype == np.int8 and games.boards.dtype == np.int8 and games.types.dtype == np.int8
    assert games.legal.dtype == bool and games.boards.shape == (300, GAME_LEN, 64)


def test_blocks_and_determinism():
    n = BLOCK + 5
    a = random_moves(n, 9)
    assert a.shape == (n, GAME_LEN)
    np.testing.assert_array_equal(a, random_moves(n, 9))
    assert not np.array_equal(a, random_moves(n, 10))
    np.testing.assert_array_equal(random_moves(0, 1), np.zeros((0, GAME_LEN), dtype=np.int8))
    assert len(random_games(0, 1)) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="n must be"):
        random_games(-1, 0)
    with pytest.raises(ValueError, match="n must be"):
        random_moves(2.5, 0)
    with pytest.raises(ValueError, match="seed must be"):
        random_moves(3, "x")
    with pytest.raises(ValueError, match="seed must be"):
        random_moves(3, -1)
    with pytest.raises(ValueError, match="uint64"):
        legal_moves(np.int64(1), np.uint64(2))
    with pytest.raises(ValueError, match="overlap"):
        useful_squares(np.uint64(3), np.uint64(1))
    with pytest.raises(ValueError, match="shape"):
        play_moves(np.zeros((2, 5), dtype=np.int64))
    with pytest.raises(ValueError, match="PASS"):
        play_moves(np.full((1, GAME_LEN), 65))
    bad = random_moves(1, 0).astype(np.int64)
    bad[0, 0] = sq("A1")
    with pytest.raises(ValueError, match="illegal move 0 at token 0 of game 0"):
        play_moves(bad)


# ---------------------------------------------------------------------------------------------------------
# Task protocol
# ---------------------------------------------------------------------------------------------------------


def test_task_protocol_shapes_and_conventions():
    task = make_task("othello")
    assert TASKS["othello"] is Othello and isinstance(task, Task)
    T, V, F = 61, 67, 64
    assert task.seq_len == T and len(task.vocab) == V and task.vocab[:3] == ("<pad>", "<bos>", "pass")
    assert task.vocab[SQUARE_OFFSET + sq("D3")] == "D3" and task.vocab[PASS_ID] == "pass"
    assert len(task.feature_names) == F and task.feature_names[0] == "sq_A1"
    assert task.useful.shape == (T, F) and task.useful.dtype == bool
    assert task.first_output_pos == 0
    n = 40
    b = task.sample(n, np.random.default_rng(0))
    assert isinstance(b, Batch)
    assert b.tokens.shape == (n, T) and b.tokens.dtype == np.int64
    assert b.loss_mask.shape == (n, T) and b.loss_mask.dtype == bool
    assert b.legal.shape == (n, T, V) and b.legal.dtype == bool
    assert b.features.shape == (n, T, F) and b.features.dtype == np.float32
    assert b.feature_types.shape == (n, T, F) and b.feature_types.dtype == np.int8
    assert np.all(b.tokens[:, 0] == 1) and np.all(b.tokens[:, 1:] >= PASS_ID) and np.all(b.tokens < V)
    assert b.loss_mask[:, :-1].all() and not b.loss_mask[:, -1].any()
    # legal[:, p] is about token p + 1: the drawn token is legal, pass is legal alone or not at all
    drawn = np.take_along_axis(b.legal[:, :-1], b.tokens[:, 1:, None], -1)[..., 0]
    assert drawn.all()
    assert not b.legal[:, :, :PASS_ID].any() and not b.legal[:, -1].any()
    p = b.legal[:, :-1, PASS_ID]
    np.testing.assert_array_equal(p, ~b.legal[:, :-1, SQUARE_OFFSET:].any(-1))
    # position 0: the opening, the first mover's view
    assert {task.vocab[v] for v in np.flatnonzero(b.legal[0, 0])} == {"D3", "C4", "F5", "E6"}
    opening = b.features[0, 0].reshape(8, 8)
    assert opening[3, 3] == -1 and opening[4, 4] == -1 and opening[4, 3] == 1 and opening[3, 4] == 1
    assert np.abs(b.features).sum(-1)[0, 0] == 4
    # position t: t + 4 stones when no pass happened; types 0 exactly on empty squares
    np.testing.assert_array_equal(b.feature_types == 0, b.features == 0)
    no_pass = ~(b.tokens[:, 1:] == PASS_ID).any(1)
    stones = np.abs(b.features[no_pass]).sum(-1)
    np.testing.assert_array_equal(stones, np.broadcast_to(np.arange(T) + 4, stones.shape))
    # features = the engine's boards shifted by one position
    games = random_games(n, np.random.default_rng(0))
    np.testing.assert_array_equal(b.features[:, 1:], games.boards)
    np.testing.assert_array_equal(b.feature_types[:, 1:], games.types)
    np.testing.assert_array_equal(b.legal[:, 1:-1, SQUARE_OFFSET:], games.legal[:, :-1])


def test_task_determinism_and_annotate():
    task = Othello()
    a = task.sample(20, np.random.default_rng(42))
    b = task.sample(20, np.random.default_rng(42))
    c = task.sample(20, np.random.default_rng(43))
    for f in ("tokens", "loss_mask", "legal", "features", "feature_types"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(a.tokens, c.tokens)
    again = task.annotate(a.tokens)
    for f in ("tokens", "loss_mask", "legal", "features", "feature_types"):
        np.testing.assert_array_equal(getattr(again, f), getattr(a, f))
    bad = a.tokens.copy()
    bad[0, 1] = SQUARE_OFFSET  # A1 is not a legal first move
    with pytest.raises(ValueError, match="illegal"):
        task.annotate(bad)
    bad = a.tokens.copy()
    bad[0, 0] = 0
    with pytest.raises(ValueError, match="<bos>"):
        task.annotate(bad)
    with pytest.raises(ValueError, match="shape"):
        task.annotate(a.tokens[:, :10])
    with pytest.raises(ValueError, match="Generator"):
        task.sample(2, 0)
    assert len(task.sample(0, np.random.default_rng(0))) == 0
