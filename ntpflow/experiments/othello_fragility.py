"""The fragility test of OthelloGPT's world model (issue 32, item 5; docs/paper.md#othello).

The paper's explanation: NTP-useless squares get no direct gradient, so they are represented less robustly than
useful ones. Test: pairs of game histories whose positions have the same legal-move set (so next-token prediction
never needs to tell them apart) and the same occupied squares, whose boards differ in the colour of some stones.

* **useless pairs**: every differing stone is NTP-useless (type 1) in both boards;
* **useful pairs**: some differing stone is NTP-useful (type 2) in one of the boards.

Pairs are found by search (:func:`find_pairs`): from the position after ``t0`` tokens of seeded random games (no
pass so far), every legal continuation of ``depth`` moves (no pass) is played; continuations ending in the same
occupied squares and the same legal set but different colours form pairs (neighbours in a fixed order; at most
``per_prefix`` pairs of each kind a prefix). Both histories have ``t0 + depth`` game tokens, so the position ``t = t0 + depth``
and the player to move agree.

Measured per layer at position ``t`` (:func:`measure`), for each kind of pair:

* ``probe_acc``: the board probes' accuracy on the differing stones: a ridge probe's prediction (``ProbeSet``; +1
  own, −1 opponent) has the stone's sign, over both boards of every pair;
* ``which_acc``: a linear "which board" decoder: ridge from the residual difference ``r_A − r_B`` to the board
  difference ``b_A − b_B`` (the ``S`` squares: 64, or 36 on the 6×6 board) fitted on the first half of the pairs; on the other half a pair counts as
  told apart when the predicted difference points the right way on the differing squares (⟨pred, b_A − b_B⟩ > 0).
  Chance is 0.5;
* ``distance``: ``|r_A − r_B|`` over the mean distance between the residuals of random pairs of the positions.

Both board sizes (8×8, and the 6×6 fallback, not the paper's setting): ``find_pairs(board_size=...)``; shapes below
with ``T = 61``, ``S = 64`` on 8×8 and ``T = 33``, ``S = 36`` on 6×6.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ntpflow.files import atomic_write, ensure_writable_dir, write_json
from ntpflow.model.gpt import GPT
from ntpflow.probes import ProbeSet
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run
from ntpflow.tasks.base import BOS_ID
from ntpflow.tasks.othello import PASS_ID, SQUARE_OFFSET
from ntpflow.tasks.othello_engine import (
    PASS,
    bitboard_to_mask,
    board,
    legal_moves,
    play,
    random_games,
    square_types,
)

KINDS = ("useless", "useful")


@dataclass(frozen=True)
class Pairs:
    """``n`` pairs of histories of ``t`` game tokens with equal legal sets and occupied squares.

    Attributes:
        tokens: int64 ``[n, 2, T]``: ``<bos>`` + the ``t`` game tokens of each history, padded with ``pass``
            (a causal model never reads the padding at position ``t``).
        boards: int8 ``[n, 2, S]``: the boards after token ``t`` (+1 own, −1 opponent, 0 empty; the player to move).
        types: int8 ``[n, 2, S]``: their square types (0 empty, 1 useless, 2 useful).
        kind: ``[n]`` strings, ``"useless"`` or ``"useful"``.
        t: the position read (number of game tokens).
    """

    tokens: np.ndarray
    boards: np.ndarray
    types: np.ndarray
    kind: np.ndarray
    t: int

    def __len__(self) -> int:
        return len(self.kind)

    @property
    def differ(self) -> np.ndarray:
        """bool ``[n, S]``: the squares whose colour differs between the two boards."""
        return self.boards[:, 0] != self.boards[:, 1]


def _children(own, opp, hist, size: int):
    """Every non-pass continuation of each position: (own, opp, history + move) with one row per legal move."""
    legal = bitboard_to_mask(legal_moves(own, opp, size=size), size=size)  # [n, S]
    rows, squares = np.nonzero(legal)
    o, p = play(own[rows], opp[rows], squares.astype(np.int64), size=size)
    return o, p, np.concatenate([hist[rows], squares[:, None].astype(np.int64)], axis=1)


def find_pairs(n_games: int, t0: int, depth: int = 3, *, seed: int = 0, per_prefix: int = 4,
               board_size: int = 8) -> Pairs:
    """Search the pairs (module docstring) from ``n_games`` seeded random games' positions after ``t0`` tokens,
    ``depth`` moves on, on the board of ``board_size`` (8 or 6). Returns the useless and useful pairs found (any
    number, possibly 0)."""
    G = board(board_size).game_len
    if not 1 <= t0 or not 1 <= depth or t0 + depth > G - 1:
        raise ValueError(f"need 1 <= t0, 1 <= depth and t0 + depth <= {G - 1}, got t0={t0}, depth={depth}")
    T, S = 1 + G, board(board_size).n_squares
    games = random_games(n_games, seed, size=board_size)
    keep = ~(games.moves[:, :t0] == PASS).any(axis=1)
    tokens, boards, types, kinds = [], [], [], []
    for g in np.nonzero(keep)[0]:
        own, opp = games.own[g, t0 - 1:t0], games.opp[g, t0 - 1:t0]
        hist = np.zeros((1, 0), dtype=np.int64)
        for _ in range(depth):
            own, opp, hist = _children(own, opp, hist, board_size)
        if len(own) < 2:
            continue
        legal = legal_moves(own, opp, size=board_size)
        occ = own | opp
        order = np.lexsort((own, legal, occ))  # groups of equal (occupied, legal), then by colouring
        found = dict.fromkeys(KINDS, 0)
        for a, b in zip(order[:-1], order[1:]):
            if min(found.values()) >= per_prefix:
                break
            if occ[a] != occ[b] or legal[a] != legal[b] or own[a] == own[b]:
                continue
            ty = square_types(np.array([own[a], own[b]]), np.array([opp[a], opp[b]]), size=board_size)  # [2, S]
            bd = bitboard_to_mask(np.array([own[a], own[b]]), size=board_size).astype(np.int8) - bitboard_to_mask(
                np.array([opp[a], opp[b]]), size=board_size).astype(np.int8)
            diff = bd[0] != bd[1]
            kind = "useful" if (ty[:, diff] == 2).any() else "useless" if (ty[:, diff] == 1).all() else None
            if kind is None or found[kind] >= per_prefix:
                continue
            seq = np.full((2, T), PASS_ID, dtype=np.int64)
            seq[:, 0] = BOS_ID
            seq[:, 1:t0 + 1] = games.moves[g, :t0].astype(np.int64) + SQUARE_OFFSET
            seq[:, t0 + 1:t0 + 1 + depth] = hist[[a, b]] + SQUARE_OFFSET
            tokens.append(seq), boards.append(bd), types.append(ty), kinds.append(kind)
            found[kind] += 1
    n = len(kinds)
    return Pairs(tokens=np.array(tokens, dtype=np.int64).reshape(n, 2, T),
                 boards=np.array(boards, dtype=np.int8).reshape(n, 2, S),
                 types=np.array(types, dtype=np.int8).reshape(n, 2, S), kind=np.array(kinds, dtype=str),
                 t=t0 + depth)


@torch.no_grad()
def pair_resid(model: GPT, pairs: Pairs) -> torch.Tensor:
    """Residuals at position ``t`` of both histories of every pair: float64 ``[L+1, n, 2, d]`` (ordinary forward)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    tok = torch.as_tensor(pairs.tokens.reshape(-1, pairs.tokens.shape[-1]), device=dev)
    _, resid = model(tok, myopic="none", return_resid=True)
    model.train(was)
    return torch.stack([r[:, pairs.t] for r in resid]).double().cpu().reshape(len(resid), len(pairs), 2, -1)


def _which_board(z: torch.Tensor, y: torch.Tensor, alpha: float) -> float:
    """Held-out share of pairs told apart by a ridge map z [n, d] -> y [n, S] fitted on the first half (NaN with
    fewer than 4 pairs). Both orientations of the training pairs are used, so the map needs no intercept."""
    n = len(z)
    if n < 4:
        return float("nan")
    h = n // 2
    x, t = torch.cat([z[:h], -z[:h]]), torch.cat([y[:h], -y[:h]])
    w = torch.linalg.solve(x.T @ x + alpha * torch.eye(x.shape[1], dtype=x.dtype), x.T @ t)
    pred = z[h:] @ w
    return float(((pred * y[h:]).sum(1) > 0).double().mean())


def measure(model: GPT, probes: ProbeSet, pairs: Pairs, *, alpha: float = 1.0, seed: int = 0) -> list[dict]:
    """Per layer and kind of pair: ``probe_acc``, ``which_acc``, ``distance`` (module docstring) and the counts.

    ``probes``: ridge board probes of the model (its task's squares in square order) fitted at position
    ``pairs.t``. The pairs are shuffled with ``seed`` before the decoder's halves are cut. Returns one dict per
    (layer, kind) with ``n_pairs`` and ``n_stones`` (differing stones over both boards)."""
    if pairs.t not in probes.positions:
        raise ValueError(f"the probes were not fitted at position {pairs.t} (have {probes.positions})")
    resid = pair_resid(model, pairs)  # [L+1, n, 2, d]
    perm = torch.as_tensor(np.random.default_rng(seed).permutation(len(pairs)))
    boards = torch.as_tensor(pairs.boards).double()
    diff = torch.as_tensor(pairs.differ)
    out = []
    for layer in range(resid.shape[0]):
        w, b = probes.weights[layer, pairs.t].double(), probes.bias[layer, pairs.t].double()  # [d, S], [S]
        pred = resid[layer] @ w + b  # [n, 2, S]
        flat = resid[layer].reshape(-1, resid.shape[-1])
        g = torch.Generator().manual_seed(seed)
        i, j = torch.randint(len(flat), (2, 4 * len(flat)), generator=g)
        scale = (flat[i] - flat[j]).norm(dim=1).mean()
        for kind in KINDS:
            sel = torch.as_tensor(pairs.kind == kind)
            rows = perm[sel[perm]]
            d = diff[rows]  # [m, S]
            stones = d[:, None, :].expand(-1, 2, -1)
            right = (torch.sign(pred[rows]) == boards[rows])[stones]
            z = resid[layer, rows, 0] - resid[layer, rows, 1]
            y = (boards[rows, 0] - boards[rows, 1]) * d
            out.append({"layer": layer, "kind": kind, "n_pairs": int(len(rows)), "n_stones": int(stones.sum()),
                        "probe_acc": float(right.double().mean()) if right.numel() else float("nan"),
                        "which_acc": _which_board(z, y, alpha),
                        "distance": float(z.norm(dim=1).mean() / scale) if len(rows) else float("nan")})
    return out


def fragility_section(results: dict[str, list[dict]], t: int) -> str:
    """Markdown section of the fragility test: ``results`` maps a regime (e.g. vanilla, myopic) to
    :func:`measure`'s rows."""
    lines = [f"## Fragility: boards with the same legal moves (position {t})", "",
             "Pairs of histories with the same legal-move set and occupied squares whose boards differ in the colour of "
             "NTP-useless stones only, or of some NTP-useful stone. Probe acc: the board probes' sign accuracy on the "
             "differing stones; which-board acc: a linear decoder of the residual difference, held-out pairs (chance "
             "0.5); distance: |r_A − r_B| over the mean distance of random pairs. The paper's explanation predicts "
             "lower numbers for useless pairs, more so for the myopic model.", "",
             "| regime | layer | kind | pairs | probe acc | which-board acc | distance |", "|---|---|---|---|---|---|---|"]
    for regime, rows in results.items():
        for r in rows:
            lines.append(f"| {regime} | {r['layer']} | {r['kind']} | {r['n_pairs']} | {r['probe_acc']:.3f} | "
                         f"{r['which_acc']:.3f} | {r['distance']:.3f} |")
    return "\n".join(lines) + "\n"


def run_fragility(run_dirs: dict[str, str | Path], out: str | Path, *, n_games: int = 400, t0: int = 24,
                  depth: int = 3, seed: int = 0, device: str = "cpu") -> Path:
    """The fragility test on finished Othello runs (``{regime: RUN_DIR}``, e.g. the medium vanilla and myopic runs):
    one seeded set of pairs (:func:`find_pairs`), each run's final weights and its final ridge probes
    (``RUN_DIR/probes``, fitted first if absent), :func:`measure`. Writes ``out/fragility.json`` (the pairs' counts
    and every row) and ``out/fragility.md`` (:func:`fragility_section`); returns ``out``. The runs share one board size
    (their configs' ``board_size``), on which the pairs are searched."""
    runs = {k: Run.open(d) for k, d in run_dirs.items()}
    for k, run in runs.items():
        if not run.done or run.cfg.task != "othello":
            raise ValueError(f"{run.dir} ({k}) is not a finished Othello run")
    sizes = {run.cfg.board_size for run in runs.values()}
    if len(sizes) > 1:
        raise ValueError(f"the runs play on different boards ({sorted(sizes)}); compare runs of one board size")
    out = ensure_writable_dir(out)
    pairs = find_pairs(n_games, t0, depth, seed=seed, board_size=sizes.pop() if sizes else 8)
    results = {k: measure(run.load_model("final", device), load_or_probe(run, "final", device), pairs, seed=seed)
               for k, run in runs.items()}
    counts = {kind: int((pairs.kind == kind).sum()) for kind in KINDS}
    differing = {kind: float(pairs.differ[pairs.kind == kind].sum(1).mean()) if counts[kind] else None
                 for kind in KINDS}
    write_json(out / "fragility.json", {"t": pairs.t, "t0": t0, "depth": depth, "n_games": n_games, "seed": seed,
                                        "pairs": counts, "mean_differing_stones": differing,
                                        "runs": {k: str(r.dir) for k, r in runs.items()}, "rows": results})
    atomic_write(out / "fragility.md", fragility_section(results, pairs.t))
    return out
