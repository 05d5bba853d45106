"""The 6×6 Othello board (issue 32's fallback, NOT the paper's setting): engine, task, config and run folder.

The engine is checked against an independent naive 6×6 Othello written below on a 2-D Python list (absolute colours,
one direction at a time, no bitboards); the 8×8 path is checked to be unchanged when ``size=8`` is given.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ntpflow.cli import main
from ntpflow.experiments.othello import SCALES, run_othello
from ntpflow.experiments.othello_fragility import find_pairs
from ntpflow.experiments.scales import site_grid
from ntpflow.files import read_json
from ntpflow.model.sites import Site
from ntpflow.replay.attribution import attribute
from ntpflow.replay.spec import AttributionSpec
from ntpflow.runs.config import TrainConfig
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run
from ntpflow.runs.training import train
from ntpflow.tasks import make_task
from ntpflow.tasks.othello import PASS_ID, SQUARE_OFFSET, Othello
from ntpflow.tasks.othello_engine import (
    PASS,
    START_OPP,
    START_OWN,
    board,
    legal_moves,
    mask_to_bitboard,
    play,
    play_moves,
    random_games,
    random_moves,
    square_types,
    useful_squares,
)

N = 6
BLACK, WHITE = 1, -1
DIRS = [(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if (dr, dc) != (0, 0)]


def naive_start() -> list[list[int]]:
    """The opening on a 6×6 grid (row 0 = the 8×8 board's row 2): white on D4 and E5, black on D5 and E4."""
    g = [[0] * N for _ in range(N)]
    g[2][2] = g[3][3] = WHITE  # D4, E5
    g[3][2] = g[2][3] = BLACK  # D5, E4
    return g


def naive_flips(g, r: int, c: int, me: int) -> list[tuple[int, int]]:
    """Stones flipped if ``me`` plays the empty (r, c); empty list: not legal."""
    out = []
    for dr, dc in DIRS:
        line, i, j = [], r + dr, c + dc
        while 0 <= i < N and 0 <= j < N and g[i][j] == -me:
            line.append((i, j))
            i, j = i + dr, j + dc
        if line and 0 <= i < N and 0 <= j < N and g[i][j] == me:
            out += line
    return out


def naive_legal(g, me: int) -> set[int]:
    return {N * r + c for r in range(N) for c in range(N) if g[r][c] == 0 and naive_flips(g, r, c, me)}


def naive_types(g, me: int) -> list[int]:
    """0 empty; 2 if flipping the stone's colour changes ``me``'s legal set; 1 otherwise (brute force)."""
    base = naive_legal(g, me)
    out = []
    for r in range(N):
        for c in range(N):
            if g[r][c] == 0:
                out.append(0)
                continue
            g[r][c] = -g[r][c]
            out.append(2 if naive_legal(g, me) != base else 1)
            g[r][c] = -g[r][c]
    return out


def replay_naive(games, types_at) -> dict:
    """Replay every game with the naive engine and compare token by token: moves, legal sets, boards, passes and
    padding, and the square types at the tokens ``types_at(i, t)`` says. Returns coverage counters."""
    G = board(6).game_len
    stats = {"mid_passes": 0, "finished": 0, "padding": 0, "type_checks": 0, "useful": 0, "useless": 0}
    for i in range(len(games)):
        g, me = naive_start(), BLACK
        legal, over = naive_legal(g, me), False
        for t in range(G):
            move = int(games.moves[i, t])
            if not legal:
                assert move == PASS, (i, t)
                if not naive_legal(g, -me):
                    over = True
                    stats["padding"] += 1
                else:
                    assert not over, (i, t)
                    stats["mid_passes"] += 1
            else:
                assert not over and move in legal, (i, t)
                r, c = divmod(move, N)
                for a, b in naive_flips(g, r, c, me):
                    g[a][b] = me
                g[r][c] = me
            me = -me
            assert games.boards[i, t].tolist() == [v * me for row in g for v in row], (i, t)
            legal = naive_legal(g, me)
            assert {int(s) for s in np.flatnonzero(games.legal[i, t])} == legal, (i, t)
            if types_at(i, t):
                want = naive_types(g, me)
                assert games.types[i, t].tolist() == want, (i, t)
                stats["type_checks"] += 1
                stats["useful"] += want.count(2)
                stats["useless"] += want.count(1)
        stats["finished"] += over or not naive_legal(g, me) and not naive_legal(g, -me)
    return stats


# ------------------------------------------------------------------------------------------------------ engine


def test_board_geometry():
    b = board(6)
    assert (b.size, b.n_squares, b.game_len) == (6, 36, 32)
    assert b.names[0] == "B2" and b.names[5] == "G2" and b.names[6] == "B3" and b.names[35] == "G7"
    assert b.names[N * 2 + 2] == "D4" and b.names[N * 3 + 3] == "E5"  # the opening's squares, (2, 2) and (3, 3)
    assert board(8).names[0] == "A1" and board(8).game_len == 60 and board(8).region == np.uint64(2**64 - 1)
    assert int(np.bitwise_count(b.region)) == 36


def test_six_by_six_games_agree_with_the_naive_engine():
    """400 seeded games: every token's move, legal set, board, pass and padding; the square types by brute force at
    every token of the first 40 games and at one token of each other."""
    games = random_games(400, 11, size=6)
    assert games.moves.shape == (400, 32) and games.boards.shape == games.legal.shape == games.types.shape == (
        400, 32, 36) and games.size == 6
    pick = np.random.default_rng(3).integers(0, 32, 400)
    stats = replay_naive(games, lambda i, t: i < 40 or t == pick[i])
    # coverage: the rules that matter were exercised
    assert stats["mid_passes"] > 0 and stats["padding"] > 0 and stats["finished"] > 0
    assert stats["type_checks"] >= 40 * 32 + 300 and stats["useful"] > 0 and stats["useless"] > 0
    assert np.array_equal(random_moves(400, 11, size=6), games.moves)
    again = play_moves(games.moves, size=6)
    for f in ("moves", "boards", "legal", "types", "own", "opp"):
        assert np.array_equal(getattr(again, f), getattr(games, f)), f
    ring = ~board(6).region
    assert not np.any((games.own | games.opp) & ring)  # no stone ever on the 8×8 ring


def test_functions_on_positions_match_the_games():
    games = random_games(50, 2, size=6)
    own, opp = games.own[:, 10], games.opp[:, 10]
    assert np.array_equal(square_types(own, opp, size=6), games.types[:, 10])
    assert np.array_equal(mask_to_bitboard(games.legal[:, 10], size=6), legal_moves(own, opp, size=6))
    assert np.array_equal(mask_to_bitboard(games.types[:, 10] == 2, size=6), useful_squares(own, opp, size=6))
    o, p = play(own, opp, games.moves[:, 11].astype(np.int64), size=6)
    assert np.array_equal(o, games.own[:, 11]) and np.array_equal(p, games.opp[:, 11])


def test_eight_by_eight_unchanged_with_the_size_given():
    a, b = random_games(300, 7), random_games(300, 7, size=8)
    for f in ("moves", "boards", "legal", "types", "own", "opp"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.boards.shape == (300, 60, 64) and a.size == b.size == 8
    assert np.array_equal(random_moves(300, 7, size=8), a.moves)
    t8, t = Othello(board_size=8), Othello()
    x, y = t8.sample(20, np.random.default_rng(1)), t.sample(20, np.random.default_rng(1))
    assert all(np.array_equal(getattr(x, k), getattr(y, k)) for k in ("tokens", "legal", "features", "feature_types"))
    assert t == t8 and t.seq_len == 61 and t.vocab_size == 67


@pytest.mark.parametrize("size", [7, 5, 4, 10, 0, True, 6.0, "6"])
def test_bad_board_sizes(size):
    with pytest.raises(ValueError, match="board size must be 6 or 8"):
        board(size)
    with pytest.raises(ValueError, match="board size must be 6 or 8"):
        random_games(2, 0, size=size)
    with pytest.raises(ValueError, match="board size must be 6 or 8"):
        Othello(board_size=size)


def test_bad_input_on_the_six_by_six_board():
    on_ring = np.uint64(1)  # A1: off the 6×6 board
    with pytest.raises(ValueError, match="outside the 6x6 board"):
        legal_moves(START_OWN | on_ring, START_OPP, size=6)
    with pytest.raises(ValueError, match="0..35"):
        play_moves(np.full((1, 32), 36), size=6)
    with pytest.raises(ValueError, match=r"shape \[N, 32\]"):
        play_moves(np.zeros((1, 60), dtype=np.int64), size=6)
    with pytest.raises(ValueError, match="illegal move"):
        play_moves(np.zeros((1, 32), dtype=np.int64), size=6)  # B2 is not a legal first move


# -------------------------------------------------------------------------------------------------------- task


def test_task_on_six_by_six():
    task = make_task("othello", board_size=6)
    assert isinstance(task, Othello) and task.seq_len == 33 and task.vocab_size == 39 and len(task.vocab) == 39
    assert task.vocab[SQUARE_OFFSET:] == board(6).names and task.vocab[PASS_ID] == "pass"
    assert task.feature_names == tuple(f"sq_{s}" for s in board(6).names) and task.n_features == 36
    assert task.useful.shape == (33, 36)
    batch = task.sample(60, np.random.default_rng(4))
    games = random_games(60, np.random.default_rng(4), size=6)
    assert batch.tokens.shape == (60, 33) and batch.legal.shape == (60, 33, 39)
    body = batch.tokens[:, 1:]
    assert np.array_equal(np.where(body == PASS_ID, PASS, body - SQUARE_OFFSET), games.moves)
    assert np.array_equal(batch.features[:, 1:], games.boards) and np.array_equal(batch.feature_types[:, 1:],
                                                                                 games.types)
    # position 0: the opening (black to move: D3, C4, F5, E6 on both boards); position p < 32: the legal set of token
    # p + 1 (or pass alone); the last position predicts nothing
    first = {task.vocab[v] for v in np.flatnonzero(batch.legal[0, 0])}
    assert first == {"D3", "C4", "F5", "E6"}
    assert np.array_equal(batch.legal[:, 1:32, SQUARE_OFFSET:], games.legal[:, :31])
    assert np.array_equal(batch.legal[:, 1:32, PASS_ID], ~games.legal[:, :31].any(-1))
    assert not batch.legal[:, 32].any() and batch.loss_mask[:, :32].all() and not batch.loss_mask[:, 32].any()
    legal_tok = np.take_along_axis(batch.legal[:, :32], batch.tokens[:, 1:, None], -1)
    assert legal_tok.all()  # every played token is legal where it is predicted
    again = task.annotate(batch.tokens)
    assert np.array_equal(again.feature_types, batch.feature_types) and np.array_equal(again.legal, batch.legal)
    train_set, _ = task.make_datasets(40, 8, seed=2)
    assert np.array_equal(train_set.tokens, task.sample(40, np.random.default_rng([2, 0])).tokens)


def test_config_board_size():
    base = TrainConfig(task="othello")
    assert base.board_size == 8
    six = TrainConfig(task="othello", board_size=6)
    assert six.hash() != base.hash()
    for bad, msg in (({"task": "othello", "board_size": 7}, "board_size must be 6 or 8"),
                     ({"task": "majority", "board_size": 6}, "othello task only")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**bad)


def test_cli_bad_board_size_exits_2(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "othello", "--set", "board_size=7", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "board_size must be 6 or 8" in err and len(err.splitlines()) == 1
    assert not out.exists()


# -------------------------------------------------------------------------------------------- a 6×6 run folder

TINY6 = {"task": "othello", "board_size": 6, "n_layer": 2, "d_model": 32, "n_head": 2, "batch_size": 16, "steps": 8,
         "lr": 3e-3, "n_train": 128, "n_eval": 64, "eval_every": 4, "ckpt_every": 4, "log_every": 2, "device": "cpu"}


def test_a_six_by_six_run_reloads_as_six_by_six(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig(**TINY6), out, progress=False)
    run = Run.open(out)
    assert run.cfg.board_size == 6 and run.task == Othello(board_size=6)
    model = run.load_model("final")
    assert model.cfg.n_ctx == 33 and model.cfg.vocab_size == 39
    _, evals = run.datasets()
    assert evals.features.shape == (64, 33, 36)
    probes = load_or_probe(run, "final", "cpu")
    assert tuple(probes.feature_names) == Othello(board_size=6).feature_names
    folder = attribute(out, AttributionSpec([Site(1, 12)], ["sq_C3", "sq_D4"], sgd_rows=False, readout=16),
                       out_dir=tmp_path / "att", progress=False)
    assert (folder / "influence.parquet").exists()
    with pytest.raises(ValueError):  # a square of the 8×8 ring is no feature of a 6×6 task
        attribute(out, AttributionSpec([Site(1, 12)], ["sq_A1"], sgd_rows=False, readout=16),
                  out_dir=tmp_path / "att2", progress=False)


def naive_after(tokens: np.ndarray, t: int):
    """(grid, player to move) after the first ``t`` game tokens of one token sequence (no passes), naively."""
    g, me = naive_start(), BLACK
    for tok in tokens[1:t + 1]:
        r, c = divmod(int(tok) - SQUARE_OFFSET, N)
        assert naive_flips(g, r, c, me)
        for a, b in naive_flips(g, r, c, me):
            g[a][b] = me
        g[r][c] = me
        me = -me
    return g, me


def test_fragility_pairs_on_six_by_six():
    pairs = find_pairs(200, 12, 3, seed=0, board_size=6)
    assert len(pairs) > 0 and set(pairs.kind) == {"useless", "useful"} and pairs.t == 15
    assert pairs.tokens.shape[1:] == (2, 33) and pairs.boards.shape[1:] == (2, 36)
    assert (pairs.tokens[:, :, pairs.t + 1:] == PASS_ID).all()
    for k in range(len(pairs)):
        (ga, ma), (gb, mb) = (naive_after(pairs.tokens[k, j], pairs.t) for j in (0, 1))
        assert ma == mb and naive_legal(ga, ma) == naive_legal(gb, mb)  # the same legal set
        for j, (g, me) in enumerate(((ga, ma), (gb, mb))):
            assert pairs.boards[k, j].tolist() == [v * me for row in g for v in row]
            assert pairs.types[k, j].tolist() == naive_types(g, me)
        diff = pairs.differ[k]
        assert diff.any() and ((pairs.boards[k, 0] == 0) == (pairs.boards[k, 1] == 0)).all()
        assert (pairs.kind[k] == "useful") == bool((pairs.types[k][:, diff] == 2).any())
    with pytest.raises(ValueError, match="t0 \\+ depth <= 31"):
        find_pairs(10, 29, 3, board_size=6)


def test_medium_six_by_six_scale_is_labelled():
    scale = SCALES["medium-6x6"]
    assert scale.train["board_size"] == 6 and "NOT the paper's setting" in scale.note
    task = Othello(board_size=6)
    assert set(scale.squares) <= set(task.feature_names) and len(scale.squares) == 16
    assert all(0 < s.pos < task.seq_len - 1 for s in scale.sites)
    assert scale.config("cpu").board_size == 6


@pytest.mark.one_thread
def test_reproduce_othello_on_a_six_by_six_smoke_scale(tmp_path):
    """The whole pipeline (train, probes, classifier, replay, report) on a 6×6 board at smoke size."""
    smoke = SCALES["smoke"]
    scale = replace(smoke, name="smoke-6x6", train={**smoke.train, "board_size": 6}, sites=site_grid((1, 2), (10,)),
                    note="a 6×6 board: NOT the paper's setting")
    out = run_othello(scale, tmp_path / "o", device="cpu", progress=False)
    data = read_json(out / "data.json")
    assert data["config"]["board_size"] == 6 and data["feature_names"] == list(Othello(board_size=6).feature_names)
    assert all(len(p["values"]) == 36 for p in data["probes"]) and {p["pos"] for p in data["probes"]} == set(
        range(1, 33))
    assert data["influence"] and {r["square"] for r in data["influence"]} == set(scale.squares)
    assert "a 6×6 board: NOT the paper's setting" in (out / "report.md").read_text()
