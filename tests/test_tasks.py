"""Tests for ntpflow.tasks (majority and conditioned majority)."""

from __future__ import annotations

import numpy as np
import pytest

from ntpflow.tasks import TASKS, Batch, CondMajority, Majority, Othello, Stories, Task, concat_batches, make_task

PAD, BOS = 0, 1
S0, S1, S2 = 2, 3, 4  # token ids of <0>, <1>, <2>


# ---------------------------------------------------------------------------
# Independent, deliberately simple per-sequence reference implementation.
# ---------------------------------------------------------------------------


def ref_argmax_set(counts: list[int]) -> set[int]:
    m = max(counts)
    return {v for v, c in enumerate(counts) if c == m}


def ref_legal_row(t: int, T: int, n_inputs: int, n_symbols: int, best) -> list[bool]:
    """Legal next tokens after position t: any symbol before the outputs, the majority set during them."""
    row = [False] * (n_symbols + 2)
    for v in (range(n_symbols) if t < n_inputs else best if t < T - 1 else ()):
        row[v + 2] = True
    return row


def ref_majority(seq: list[int], n_inputs: int, n_symbols: int):
    """Return (features [T][S], legal [T][V], loss_mask [T]) for one majority sequence."""
    T = len(seq)
    features, legal, loss_mask = [], [], []
    for t in range(T):
        counts = [0] * n_symbols
        for s in range(1, t + 1):
            counts[seq[s] - 2] += 1
        best = ref_argmax_set(counts)
        features.append([1.0 if v in best else 0.0 for v in range(n_symbols)])
        legal.append(ref_legal_row(t, T, n_inputs, n_symbols, best))
        loss_mask.append(t < T - 1)
    return features, legal, loss_mask


def ref_cond_majority(seq: list[int], n_inputs: int, n_symbols: int):
    """Return (features [T][S], legal [T][V], loss_mask [T]) for one cond-majority sequence."""
    T = len(seq)
    counts = [0] * n_symbols
    for t in range(2, n_inputs + 1):
        if seq[t - 1] == S0:
            counts[seq[t] - 2] += 1
    best = ref_argmax_set(counts)
    features, legal, loss_mask = [], [], []
    for t in range(T):
        f = [0.0] * n_symbols
        if t >= 2:
            f[seq[t - 1] - 2] = 1.0
        features.append(f)
        legal.append(ref_legal_row(t, T, n_inputs, n_symbols, best))
        loss_mask.append(t < T - 1)
    return features, legal, loss_mask


REFS = {"majority": ref_majority, "cond_majority": ref_cond_majority}


def check_against_reference(task, batch: Batch) -> None:
    ref = REFS[task.name]
    for i in range(len(batch)):
        seq = [int(x) for x in batch.tokens[i]]
        assert seq[0] == BOS
        assert all(2 <= x < 2 + task.n_symbols for x in seq[1:])
        feats, legal, lm = ref(seq, task.n_inputs, task.n_symbols)
        np.testing.assert_array_equal(batch.features[i], np.array(feats, dtype=np.float32))
        np.testing.assert_array_equal(batch.legal[i], np.array(legal, dtype=bool))
        np.testing.assert_array_equal(batch.loss_mask[i], np.array(lm, dtype=bool))
        # every token after position 0 is legal given its prefix (legal row p is token p+1)
        for p in range(len(seq) - 1):
            assert legal[p][seq[p + 1]], (i, p, seq)


# ---------------------------------------------------------------------------
# Basic structure
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_shapes_dtypes_and_metadata(name):
    task = make_task(name)
    assert task.name == name
    assert isinstance(task, Task)
    assert task.vocab == ("<pad>", "<bos>", "<0>", "<1>", "<2>")
    assert task.vocab_size == 5
    assert task.seq_len == 21
    assert task.first_output_pos == 10
    assert len(task.feature_names) == 3
    prefix = "is_majority_" if name == "majority" else "prev_is_"
    assert task.feature_names == tuple(f"{prefix}{v}" for v in range(3))  # no shell quoting needed

    useful = task.useful
    assert useful.shape == (21, 3) and useful.dtype == bool
    assert not useful[:10].any() and useful[10:].all()

    b = task.sample(7, np.random.default_rng(0))
    assert len(b) == 7
    assert b.tokens.shape == (7, 21) and b.tokens.dtype == np.int64
    assert b.loss_mask.shape == (7, 21) and b.loss_mask.dtype == bool
    assert b.legal.shape == (7, 21, 5) and b.legal.dtype == bool
    assert b.features.shape == (7, 21, 3) and b.features.dtype == np.float32
    assert b.feature_types is None
    assert (b.tokens[:, 0] == BOS).all()
    assert ((b.tokens[:, 1:] >= 2) & (b.tokens[:, 1:] <= 4)).all()
    assert b.loss_mask[:, :20].all() and not b.loss_mask[:, 20].any()
    assert not b.legal[:, 20].any()
    assert not b.legal[:, :, :2].any()  # pad / bos never legal
    assert b.legal[:, :10, 2:].all()  # inputs are uniform
    assert b.legal[:, 10:20, 2:].any(axis=-1).all()  # non-empty output sets


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_custom_sizes(name):
    task = make_task(name, n_inputs=6, n_outputs=4, n_symbols=4)
    assert task.seq_len == 11 and task.first_output_pos == 6 and task.vocab_size == 6
    b = task.sample(200, np.random.default_rng(3))
    assert b.tokens.shape == (200, 11) and b.features.shape == (200, 11, 4)
    assert b.legal.shape == (200, 11, 6)
    check_against_reference(task, b)


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_matches_reference_implementation(name):
    task = make_task(name)
    batch = task.sample(300, np.random.default_rng(1234))
    check_against_reference(task, batch)


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_annotate_roundtrip(name):
    task = make_task(name)
    b = task.sample(50, np.random.default_rng(5))
    a = task.annotate(b.tokens.copy())
    for field in ("tokens", "loss_mask", "legal", "features"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    with pytest.raises(ValueError):
        task.annotate(b.tokens[:, :-1])
    bad = b.tokens.copy()
    bad[0, 3] = PAD
    with pytest.raises(ValueError):
        task.annotate(bad)


# ---------------------------------------------------------------------------
# Hand-worked examples
# ---------------------------------------------------------------------------


def test_majority_hand_example():
    task = Majority()
    inputs = [S0, S1, S1, S2, S0, S1, S2, S2, S0, S0]
    # after inputs: count(<0>)=4, count(<1>)=3, count(<2>)=3 -> majority {<0>}
    seq = [BOS] + inputs + [S0] * 10
    b = task.annotate(np.array([seq]))
    f = b.features[0]
    expected_prefix = [
        [1, 1, 1],  # t=0 BOS: all counts 0
        [1, 0, 0],  # <0>
        [1, 1, 0],  # <0>,<1> tie
        [0, 1, 0],  # <1> leads 2-1
        [0, 1, 0],  # counts 1,2,1
        [1, 1, 0],  # 2,2,1
        [0, 1, 0],  # 2,3,1
        [0, 1, 0],  # 2,3,2
        [0, 1, 1],  # 2,3,3
        [1, 1, 1],  # 3,3,3
        [1, 0, 0],  # 4,3,3
    ]
    np.testing.assert_array_equal(f[:11], np.array(expected_prefix, dtype=np.float32))
    np.testing.assert_array_equal(f[11:], np.tile([1, 0, 0], (10, 1)))
    # legal at p=10 (first output) and beyond: only <0>
    assert b.legal[0, 10].tolist() == [False, False, True, False, False]
    assert (b.legal[0, 10:20] == b.legal[0, 10]).all()
    # legal at input positions: all symbols; at p=9 (predicting input 10) too
    assert b.legal[0, 9].tolist() == [False, False, True, True, True]


def test_majority_hand_example_with_tie_and_outputs():
    task = Majority()
    # counts after inputs: <0>=4, <1>=4, <2>=2 -> tie between <0> and <1>
    inputs = [S0, S1, S0, S1, S2, S0, S1, S2, S0, S1]
    seq = [BOS] + inputs + [S1] * 10
    b = task.annotate(np.array([seq]))
    # position 10: tie {<0>,<1>}
    assert b.features[0, 10].tolist() == [1.0, 1.0, 0.0]
    assert b.legal[0, 10].tolist() == [False, False, True, True, False]
    # after first output <1>: <1> is the strict majority, so only <1> is legal afterwards
    assert b.features[0, 11].tolist() == [0.0, 1.0, 0.0]
    for p in range(11, 20):
        assert b.legal[0, p].tolist() == [False, False, False, True, False]
    assert not b.legal[0, 20].any()


def test_cond_majority_hand_example():
    task = CondMajority()
    #   pos 1..10: <0> <2> <1> <0> <2> <0> <0> <1> <2> <0>
    inputs = [S0, S2, S1, S0, S2, S0, S0, S1, S2, S0]
    # followers of <0> (within inputs): pos2=<2>, pos5=<2>, pos7=<0>, pos8=<1>;
    # the <0> at position 10 is followed by an output, which does not count.
    # counts: <0>=1, <1>=1, <2>=2 -> set {<2>}
    seq = [BOS] + inputs + [S2] * 10
    b = task.annotate(np.array([seq]))
    f = b.features[0]
    assert f[0].tolist() == [0, 0, 0]
    assert f[1].tolist() == [0, 0, 0]  # previous token is BOS
    assert f[2].tolist() == [1, 0, 0]  # previous is <0>
    assert f[3].tolist() == [0, 0, 1]  # previous is <2>
    assert f[4].tolist() == [0, 1, 0]
    assert f[11].tolist() == [1, 0, 0]  # previous token (pos 10) is <0>
    assert f[12].tolist() == [0, 0, 1]  # previous token is output <2>
    for p in range(10, 20):
        assert b.legal[0, p].tolist() == [False, False, False, False, True]
    assert b.legal[0, :10, 2:].all()


def test_cond_majority_first_input_after_bos_not_counted():
    task = CondMajority()
    # BOS then <1>: the <1> at position 1 follows BOS, not <0>. Only <0><1> at (3,4) counts.
    inputs = [S1, S2, S0, S1, S2, S2, S2, S2, S2, S2]
    seq = [BOS] + inputs + [S1] * 10
    b = task.annotate(np.array([seq]))
    assert b.legal[0, 10].tolist() == [False, False, False, True, False]


def test_cond_majority_all_tie():
    task = CondMajority()
    # no <0> among inputs 1..9 -> nothing counted -> all three tie
    inputs = [S1, S2, S2, S1, S1, S2, S1, S2, S1, S0]
    seq = [BOS] + inputs + [S2, S0, S1, S1, S0, S2, S2, S0, S1, S0]
    b = task.annotate(np.array([seq]))
    assert b.legal[0, 10:20, 2:].all()
    assert not b.legal[0, 10:20, :2].any()

    # sampled: all-tie rows have all-true output sets and their outputs vary
    batch = task.sample(4000, np.random.default_rng(7))
    inp = batch.tokens[:, 1:11]
    no_key = ~(inp[:, :-1] == S0).any(axis=1)
    assert no_key.sum() > 20  # (2/3)^9 ~ 2.6% of rows
    assert batch.legal[no_key, 10:20, 2:].all()
    outs = batch.tokens[no_key, 11:]
    all_same = (outs == outs[:, :1]).all(axis=1)
    assert all_same.mean() < 0.05  # i.i.d. uniform over 3: P(all same) = 3^-9
    # tie also arises when counted followers tie, e.g. 1-1-1 or 2-2
    sets = batch.legal[:, 10, 2:]
    assert sets.sum(axis=1).max() == 3 and sets.sum(axis=1).min() == 1


def test_cond_majority_outputs_iid_within_set():
    task = CondMajority()
    b = task.sample(3000, np.random.default_rng(11))
    sizes = b.legal[:, 10, 2:].sum(axis=1)
    # set is constant over outputs
    assert (b.legal[:, 10:20] == b.legal[:, 10:11]).all()
    two = sizes == 2
    outs = b.tokens[two, 11:]
    # outputs are not forced to repeat: with 2 options, mostly not all identical
    assert (outs != outs[:, :1]).any(axis=1).mean() > 0.9


# ---------------------------------------------------------------------------
# Sampling rules
# ---------------------------------------------------------------------------


def test_majority_outputs_repeat_first():
    task = Majority()
    b = task.sample(2000, np.random.default_rng(2))
    outs = b.tokens[:, 11:]
    assert (outs == outs[:, :1]).all()
    # the first output is a member of the majority set of the inputs
    first = b.tokens[:, 11] - 2
    assert b.features[np.arange(len(b)), 10, first].all()
    # after the first output the set is the singleton {first output}
    assert (b.legal[:, 11:20, 2:].sum(axis=-1) == 1).all()


def test_majority_uniform_over_ties():
    task = Majority()
    b = task.sample(20000, np.random.default_rng(3))
    sets = b.legal[:, 10, 2:]
    tie = sets.sum(axis=1) == 2
    assert tie.sum() > 1000
    first = b.tokens[tie, 11] - 2
    members = np.sort(np.nonzero(sets[tie])[1].reshape(-1, 2), axis=1)
    picked_lower = first == members[:, 0]
    assert abs(picked_lower.mean() - 0.5) < 0.05
    # inputs are i.i.d. uniform
    freq = np.bincount(b.tokens[:, 1:11].ravel() - 2, minlength=3) / b.tokens[:, 1:11].size
    assert np.allclose(freq, 1 / 3, atol=0.01)


# ---------------------------------------------------------------------------
# Determinism, registry, Batch helpers, scale
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_determinism(name):
    task = make_task(name)
    a = task.sample(500, np.random.default_rng(42))
    b = task.sample(500, np.random.default_rng(42))
    c = task.sample(500, np.random.default_rng(43))
    for field in ("tokens", "loss_mask", "legal", "features"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_no_global_rng(name):
    task = make_task(name)
    np.random.seed(0)
    a = task.sample(100, np.random.default_rng(9))
    np.random.seed(1)
    b = task.sample(100, np.random.default_rng(9))
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_registry_and_unknown_task():
    assert TASKS == {"majority": Majority, "cond_majority": CondMajority, "othello": Othello, "stories": Stories}
    assert isinstance(make_task("majority"), Majority)
    assert isinstance(make_task("cond_majority", n_inputs=5), CondMajority)
    with pytest.raises(ValueError, match="unknown task 'othello_nope'"):
        make_task("othello_nope")


def test_task_hooks_declared_with_defaults(tmp_path):
    # every shipped task subclasses Task and so has its optional hooks; the defaults are
    # config_fields=(), two seeded sample streams ([seed, 0] train, [seed, 1] eval), and nothing saved
    for cls in TASKS.values():
        assert Task in cls.__mro__ and isinstance(cls.config_fields, tuple)
        assert callable(cls.make_datasets) and callable(cls.save_artifacts)
    assert Stories.config_fields == ("corpus", "vocab_size") and Majority.config_fields == ()
    task = make_task("majority")
    train, evals = task.make_datasets(30, 20, 7)
    np.testing.assert_array_equal(train.tokens, task.sample(30, np.random.default_rng([7, 0])).tokens)
    np.testing.assert_array_equal(evals.tokens, task.sample(20, np.random.default_rng([7, 1])).tokens)
    task.save_artifacts(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_batch_indexing_and_concat():
    task = Majority()
    b = task.sample(10, np.random.default_rng(0))
    s = b[2:5]
    assert isinstance(s, Batch) and len(s) == 3
    np.testing.assert_array_equal(s.tokens, b.tokens[2:5])
    idx = np.array([0, 3, 9])
    np.testing.assert_array_equal(b[idx].features, b.features[idx])
    mask = np.zeros(10, dtype=bool)
    mask[[1, 2]] = True
    assert len(b[mask]) == 2
    one = b[4]
    assert len(one) == 1 and one.tokens.shape == (1, 21)
    np.testing.assert_array_equal(b[-1].tokens, b.tokens[-1:])
    with pytest.raises(IndexError):
        b[10]
    cat = concat_batches([b[:4], b[4:]])
    for field in ("tokens", "loss_mask", "legal", "features"):
        np.testing.assert_array_equal(getattr(cat, field), getattr(b, field))
    with pytest.raises(ValueError):
        concat_batches([])
    with pytest.raises(ValueError):
        Batch(tokens=b.tokens, loss_mask=b.loss_mask[:, :5], legal=b.legal, features=b.features)


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_zero_and_large_batches(name):
    task = make_task(name)
    empty = task.sample(0, np.random.default_rng(0))
    assert len(empty) == 0 and empty.features.shape == (0, 21, 3)
    big = task.sample(100_000, np.random.default_rng(0))
    assert big.tokens.shape == (100_000, 21)
    # every output token is in its legal set
    n = len(big)
    for p in range(20):
        assert big.legal[np.arange(n), p, big.tokens[:, p + 1]].all()


@pytest.mark.parametrize("name", ["majority", "cond_majority"])
def test_optimal_loss_matches_sampled_legal_sets(name):
    """Outputs are uniform over the legal set, so the Bayes-optimal loss is the mean over counted positions of
    ln |legal set|; its sample mean over many sequences must agree with the exact enumeration within 5 standard
    errors."""
    task = make_task(name, n_inputs=5, n_outputs=4)
    batch = task.sample(40_000, np.random.default_rng(0))
    counted = batch.loss_mask[:, :-1]  # positions 0..T-2 predict tokens 1..T-1
    per_seq = (np.log(batch.legal[:, :-1, 2:].sum(-1)) * counted).sum(1) / counted.sum(1)
    stderr = per_seq.std() / np.sqrt(len(per_seq))
    assert abs(per_seq.mean() - task.optimal_loss()) < 5 * stderr + 1e-12


def test_optimal_loss_hand_worked():
    # one input: the first majority output is that input (no entropy), so only the input costs ln 3 of T - 1 = 3
    assert make_task("majority", n_inputs=1, n_outputs=2).optimal_loss() == pytest.approx(np.log(3) / 3, rel=1e-12)
    # cond_majority with 2 inputs over 2 symbols: the second input is counted iff the first is <0>; the set is
    # {second} (size 1) then, else both symbols tie (ln 2): E = ln 2 / 2 per output
    task = make_task("cond_majority", n_inputs=2, n_outputs=3, n_symbols=2)
    assert task.optimal_loss() == pytest.approx((2 * np.log(2) + 3 * np.log(2) / 2) / 5, rel=1e-12)
