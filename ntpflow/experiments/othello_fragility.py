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
  difference ``b_A − b_B`` (the ``S`` squares: 64, or 36 on the 6×6 board) fitted on the first half of the pairs;
  on the other half a pair counts as told apart when the predicted difference points the right way on the
  differing squares (⟨pred, b_A − b_B⟩ > 0).
  Chance is 0.5;
* ``distance``: ``|r_A − r_B|`` over the mean distance between the residuals of random pairs of the positions.

Both board sizes (8×8, and the 6×6 fallback, not the paper's setting): ``find_pairs(board_size=...)``; shapes below
with ``T = 61``, ``S = 64`` on 8×8 and ``T = 33``, ``S = 36`` on 6×6.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ntpflow.files import atomic_write, ensure_writable_dir, json_safe, write_json
from ntpflow.model.gpt import GPT
from ntpflow.probes import ProbeSet
from ntpflow.runs.probe import load_or_probe
from ntpflow.runs.run import Run
from ntpflow.stats import bootstrap_ci, wilson_ci
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
            tokens.append(seq)
            boards.append(bd)
            types.append(ty)
            kinds.append(kind)
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


def _told_apart(z: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """bool ``[n - n // 2]``: the held-out pairs (the second half) told apart by a ridge map z [n, d] -> y [n, S]
    fitted on the first half (empty with fewer than 4 pairs). Both orientations of the training pairs are used, so
    the map needs no intercept."""
    n = len(z)
    if n < 4:
        return torch.zeros(0, dtype=torch.bool)
    h = n // 2
    x, t = torch.cat([z[:h], -z[:h]]), torch.cat([y[:h], -y[:h]])
    w = torch.linalg.solve(x.T @ x + alpha * torch.eye(x.shape[1], dtype=x.dtype), x.T @ t)
    return (z[h:] @ w * y[h:]).sum(1) > 0


def _which_board(z: torch.Tensor, y: torch.Tensor, alpha: float) -> float:
    """Held-out share of pairs told apart (:func:`_told_apart`; NaN with fewer than 4 pairs)."""
    told = _told_apart(z, y, alpha)
    return float(told.double().mean()) if len(told) else float("nan")


def pair_values(model: GPT, probes: ProbeSet, pairs: Pairs, *, alpha: float = 1.0, seed: int = 0) -> dict:
    """The per-pair numbers behind :func:`measure`, ``{kind: {name: float64 array}}`` with ``right`` and ``stones``
    ``[L+1, m]`` (differing stones signed right by the probes, over both boards; differing stones), ``distance``
    ``[L+1, m]`` (``|r_A − r_B|`` over the layer's random-pair scale) and ``told`` ``[L+1, m − m // 2]`` (held-out
    pairs told apart, 1/0). The ``m`` pairs of a kind are in the order of the ``seed``'s shuffle, the same for every
    model, so the arrays of two models on the same pairs are paired. ``probes``: ridge board probes of the model (its
    task's squares in square order) fitted at position ``pairs.t``."""
    if pairs.t not in probes.positions:
        raise ValueError(f"the probes were not fitted at position {pairs.t} (have {probes.positions})")
    resid = pair_resid(model, pairs)  # [L+1, n, 2, d]
    perm = torch.as_tensor(np.random.default_rng(seed).permutation(len(pairs)))
    boards = torch.as_tensor(pairs.boards).double()
    diff = torch.as_tensor(pairs.differ)
    out = {kind: {"right": [], "stones": [], "distance": [], "told": []} for kind in KINDS}
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
            right = ((torch.sign(pred[rows]) == boards[rows]) & stones).sum((1, 2))
            z = resid[layer, rows, 0] - resid[layer, rows, 1]
            y = (boards[rows, 0] - boards[rows, 1]) * d
            v = out[kind]
            v["right"].append(right.double())
            v["stones"].append(stones.sum((1, 2)).double())
            v["distance"].append(z.norm(dim=1) / scale)
            v["told"].append(_told_apart(z, y, alpha).double())
    return {kind: {k: torch.stack(a).numpy() for k, a in v.items()} for kind, v in out.items()}


METRICS = ("probe_acc", "which_acc", "distance")


def _metric(v: dict, metric: str, idx: np.ndarray, layers) -> float:
    """``metric`` of one kind's per-pair arrays ``v`` on the pairs ``idx`` (held-out pairs for which_acc), mean over
    ``layers``: probe_acc pools the stones, the others average the pairs."""
    layers = list(layers)
    if metric == "probe_acc":
        stones = v["stones"][layers][:, idx].sum(1)
        vals = v["right"][layers][:, idx].sum(1) / np.where(stones > 0, stones, np.nan)
    else:
        x = v["told" if metric == "which_acc" else "distance"][layers][:, idx]
        vals = x.mean(1) if x.shape[1] else np.full(len(layers), np.nan)
    return float(vals.mean())


def _n_units(v: dict, metric: str) -> int:
    return v["told" if metric == "which_acc" else "distance"].shape[1]


def measure(model: GPT, probes: ProbeSet, pairs: Pairs, *, alpha: float = 1.0, seed: int = 0,
            n_boot: int = 1000) -> list[dict]:
    """Per layer and kind of pair: ``probe_acc``, ``which_acc``, ``distance`` (module docstring) with their 95%
    intervals (``<metric>_lo``, ``<metric>_hi``: a percentile bootstrap over the pairs for probe_acc and distance,
    Wilson over the held-out pairs for which_acc; None where undefined) and the counts.

    ``probes``: ridge board probes of the model (``sq_A1`` .. ``sq_H8`` in square order) fitted at position
    ``pairs.t``. The pairs are shuffled with ``seed`` before the decoder's halves are cut. Returns one dict per
    (layer, kind) with ``n_pairs``, ``n_stones`` (differing stones over both boards) and ``n_held_out``."""
    return rows_of(pair_values(model, probes, pairs, alpha=alpha, seed=seed), seed=seed, n_boot=n_boot)


def rows_of(values: dict, *, seed: int = 0, n_boot: int = 1000) -> list[dict]:
    """:func:`measure`'s rows from :func:`pair_values`' arrays."""
    out = []
    for layer in range(values[KINDS[0]]["right"].shape[0]):
        for kind in KINDS:
            v = values[kind]
            row = {"layer": layer, "kind": kind, "n_pairs": _n_units(v, "probe_acc"),
                   "n_stones": int(v["stones"][layer].sum()), "n_held_out": _n_units(v, "which_acc")}
            for metric in METRICS:
                if metric == "which_acc":
                    told = v["told"][layer]
                    ci = wilson_ci(int(told.sum()), len(told))
                else:
                    ci = bootstrap_ci(lambda i, m=metric: _metric(v, m, i, [layer]), [_n_units(v, metric)],
                                      n_boot=n_boot, seed=seed)
                mean = _metric(v, metric, np.arange(_n_units(v, metric)), [layer])
                row |= {metric: mean, f"{metric}_lo": ci["lo"], f"{metric}_hi": ci["hi"]}
            out.append(row)
    return out


def gap_ci(values: dict, metric: str, layers, *, against: dict | None = None, seed: int = 0,
           n_boot: int = 1000) -> dict:
    """useful − useless of ``metric`` (mean over ``layers``) with its percentile bootstrap 95% interval over the pairs
    (the useful and the useless pairs resampled independently); with ``against`` (another model's
    :func:`pair_values` on the same pairs), the difference of the two gaps, ``gap(values) − gap(against)``, with the
    same resampled pairs for both models (paired). ``{"mean", "lo", "hi", "n_boot", "n", "n_useful", "n_useless"}``
    (``n``: the pairs, or held-out pairs for which_acc, of both kinds)."""
    def gap(v, iu, il):
        return _metric(v["useful"], metric, iu, layers) - _metric(v["useless"], metric, il, layers)

    def stat(iu, il):
        return gap(values, iu, il) - (gap(against, iu, il) if against is not None else 0.0)

    sizes = [_n_units(values[k], metric) for k in ("useful", "useless")]
    return {**bootstrap_ci(stat, sizes, n_boot=n_boot, seed=seed), "n": sum(sizes), "n_useful": sizes[0],
            "n_useless": sizes[1]}


def comparisons(values: dict[str, dict], *, seed: int = 0, n_boot: int = 1000) -> list[dict]:
    """The tests of the paper's prediction on :func:`pair_values` of several models (``{regime: values}``), per
    metric, for each layer and for the mean over the middle layers (1 .. L − 1, or 1 with one block; ``layer``
    "middle"): each regime's gap useful − useless (predicted > 0), and, with both a vanilla and a myopic model, the
    myopic gap minus the vanilla one (``regime`` "myopic − vanilla", predicted > 0)."""
    n_resid = next(iter(values.values()))[KINDS[0]]["right"].shape[0]
    middle = list(range(1, max(n_resid - 1, 2)))
    out = []
    for metric in METRICS:
        for layer, layers in [*((k, [k]) for k in range(n_resid)), ("middle", middle)]:
            for regime, v in values.items():
                out.append({"metric": metric, "layer": layer, "regime": regime,
                            **gap_ci(v, metric, layers, seed=seed, n_boot=n_boot)})
            if {"vanilla", "myopic"} <= set(values):
                out.append({"metric": metric, "layer": layer, "regime": "myopic − vanilla",
                            **gap_ci(values["myopic"], metric, layers, against=values["vanilla"], seed=seed,
                                     n_boot=n_boot)})
    return out


def _ci(r: dict, metric: str) -> str:
    lo, hi = r.get(f"{metric}_lo"), r.get(f"{metric}_hi")
    v = r[metric]
    return "n/a" if v is None or v != v else f"{v:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")


def fragility_section(results: dict[str, list[dict]], t: int) -> str:
    """Markdown section of the fragility test: ``results`` maps a regime (e.g. vanilla, myopic) to
    :func:`measure`'s rows."""
    lines = [f"## Fragility: boards with the same legal moves (position {t})", "",
             "Pairs of histories with the same legal-move set and occupied squares whose boards differ in the colour of "
             "NTP-useless stones only, or of some NTP-useful stone. Probe acc: the board probes' sign accuracy on the "
             "differing stones; which-board acc: a linear decoder of the residual difference, held-out pairs (chance "
             "0.5); distance: |r_A − r_B| over the mean distance of random pairs. 95% intervals in brackets (bootstrap "
             "over pairs; Wilson for which-board). The paper's explanation predicts lower numbers for useless pairs, "
             "more so for the myopic model.", "",
             "| regime | layer | kind | pairs | probe acc | which-board acc | distance |", "|---|---|---|---|---|---|---|"]
    for regime, rows in results.items():
        for r in rows:
            lines.append(f"| {regime} | {r['layer']} | {r['kind']} | {r['n_pairs']} | {_ci(r, 'probe_acc')} | "
                         f"{_ci(r, 'which_acc')} | {_ci(r, 'distance')} |")
    return "\n".join(lines) + "\n"


#: the result file of :func:`run_fragility` in its folder
FRAGILITY_JSON = "fragility.json"


def run_fragility(run_dirs: dict[str, str | Path], out: str | Path, *, n_games: int = 400, t0: int = 24,
                  depth: int = 3, seed: int = 0, device: str = "cpu", n_boot: int = 1000) -> Path:
    """The fragility test on finished Othello runs (``{regime: RUN_DIR}``, e.g. the medium vanilla and myopic runs):
    one seeded set of pairs (:func:`find_pairs`), each run's final weights and its final ridge probes
    (``RUN_DIR/probes``, fitted first if absent), :func:`pair_values`, :func:`rows_of` and :func:`comparisons`.
    Writes ``out/fragility.json`` (the pairs' counts, every row and comparison, the runs' folders relative to
    ``out``) and ``out/fragility.md`` (:func:`fragility_section`); returns ``out``. The runs share one board size
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
    values = {k: pair_values(run.load_model("final", device), load_or_probe(run, "final", device), pairs, seed=seed)
              for k, run in runs.items()}
    results = {k: rows_of(v, seed=seed, n_boot=n_boot) for k, v in values.items()}
    counts = {kind: int((pairs.kind == kind).sum()) for kind in KINDS}
    differing = {kind: float(pairs.differ[pairs.kind == kind].sum(1).mean()) if counts[kind] else None
                 for kind in KINDS}
    write_json(out / FRAGILITY_JSON, json_safe({
        "t": pairs.t, "t0": t0, "depth": depth, "n_games": n_games, "seed": seed, "n_boot": n_boot,
        "pairs": counts, "mean_differing_stones": differing,
        "runs": {k: os.path.relpath(r.dir.resolve(), out.resolve()) for k, r in runs.items()}, "rows": results,
        "comparisons": comparisons(values, seed=seed, n_boot=n_boot)}))
    atomic_write(out / "fragility.md", fragility_section(results, pairs.t))
    return out
