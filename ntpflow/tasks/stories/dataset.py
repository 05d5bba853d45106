"""Fixed-length story windows with per-token features, as :class:`ntpflow.tasks.Batch` objects
(docs/paper.md#tinystories).

As in the reference: stories with fewer than ``seq_len`` (64) tokens are skipped; every other story gives one
window of ``seq_len`` consecutive tokens starting at a uniformly random offset ``0..L - seq_len``. There is no
``<bos>``: unlike the synthetic tasks (whose position 0 is ``<bos>``), position 0 of a window is simply its first
story token, and token ids are the tokenizer's own. Logits at position ``p`` predict token ``p + 1``;
``loss_mask`` is True everywhere except the last position, which has no next token in the window. ``legal`` is
None (undefined for natural text).

Features are computed on the *whole* story and then cut to the window, so ``pos_int`` is the index in the story
(``start + p``), not in the window, and ``pos_prop = pos_int / L``.

Differences from the reference, by design: stories are taken in source order until ``n_windows`` are found and the
corpus is not cycled when it runs out (a too-small corpus is an error instead of repeated stories); the train/eval
split is by story (separate files, or :func:`~ntpflow.tasks.stories.corpus.split_stories`).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ntpflow.files import atomic_write
from ntpflow.tasks.base import Batch
from ntpflow.tasks.stories.corpus import Corpus
from ntpflow.tasks.stories.features import FEATURE_NAMES, Featurizer, StoryFeatures, featurize

__all__ = [
    "SEQ_LEN",
    "StoryData",
    "StoryWindows",
    "build_story_data",
    "build_windows",
    "make_windows",
    "select_long_stories",
]

SEQ_LEN = 64


@dataclass(frozen=True, eq=False)
class StoryWindows:
    """``n`` windows of ``T`` tokens with their ``F = 22`` features.

    Attributes:
        tokens: int64 ``[n, T]`` token ids (no ``<bos>``).
        features: float32 ``[n, T, F]``; column order :attr:`feature_names`.
        story_index: int64 ``[n]`` index of each window's story in the split it came from.
        start: int64 ``[n]`` offset of each window in its story (in tokens).
        story_len: int64 ``[n]`` length of each window's story (in tokens).
        feature_names: the ``F`` feature names (:data:`~ntpflow.tasks.stories.features.FEATURE_NAMES`).
    """

    tokens: np.ndarray
    features: np.ndarray
    story_index: np.ndarray
    start: np.ndarray
    story_len: np.ndarray
    feature_names: tuple[str, ...] = FEATURE_NAMES

    def __post_init__(self) -> None:
        n, T = self.tokens.shape
        if self.features.shape != (n, T, len(self.feature_names)):
            raise ValueError(f"features shape {self.features.shape} != {(n, T, len(self.feature_names))}")
        for name in ("story_index", "start", "story_len"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} shape {getattr(self, name).shape} != {(n,)}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Window length ``T``."""
        return int(self.tokens.shape[1])

    def to_batch(self, idx=None) -> Batch:
        """The windows ``idx`` (all if None; int, slice or index array) as a :class:`~ntpflow.tasks.Batch`.

        ``tokens`` int64 ``[b, T]``; ``loss_mask`` bool ``[b, T]``, False only at ``T - 1``; ``legal`` None;
        ``features`` float32 ``[b, T, 22]``; ``feature_types`` None.
        """
        if idx is None:
            idx = slice(None)
        elif isinstance(idx, (int, np.integer)):
            idx = [int(idx)]
        tokens = self.tokens[idx]
        mask = np.ones(tokens.shape, dtype=bool)
        mask[:, -1] = False
        return Batch(tokens=tokens, loss_mask=mask, legal=None, features=self.features[idx])

    def iter_batches(self, batch_size: int, rng: np.random.Generator, drop_last: bool = True) -> Iterator[Batch]:
        """One shuffled pass (an epoch) over the windows in batches of ``batch_size``, order drawn from ``rng``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = rng.permutation(len(self))
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        for i in range(0, stop, batch_size):
            yield self.to_batch(order[i:i + batch_size])

    def save(self, path: str | os.PathLike) -> None:
        """Write the windows to an ``.npz`` file (atomically, no pickles)."""
        buf = io.BytesIO()
        np.savez(buf, tokens=self.tokens, features=self.features, story_index=self.story_index, start=self.start,
                 story_len=self.story_len, feature_names=np.array(json.dumps(list(self.feature_names))))
        atomic_write(Path(path), buf.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike) -> StoryWindows:
        """Read windows written by :meth:`save`; a missing or corrupted file is a one-line error."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"missing windows file {path}")
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(tokens=z["tokens"], features=z["features"], story_index=z["story_index"],
                           start=z["start"], story_len=z["story_len"],
                           feature_names=tuple(json.loads(str(z["feature_names"]))))
        except Exception as e:  # noqa: BLE001 - numpy/zipfile/json raise many types
            raise ValueError(f"corrupted windows file {path} ({type(e).__name__}: {e})") from None


@dataclass(frozen=True, eq=False)
class StoryData:
    """Train and eval windows of one corpus with the tokenizer that made them.

    Attributes:
        train, eval: the :class:`StoryWindows` of each split.
        tokenizer: the :class:`~ntpflow.tasks.stories.tokenizer.StoryTokenizer` (``vocab_size`` sizes the model).
        corpus_name: where the stories came from.
    """

    train: StoryWindows
    eval: StoryWindows
    tokenizer: object
    corpus_name: str

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The feature names (those of the train windows)."""
        return self.train.feature_names


def select_long_stories(stories, tokenizer, seq_len: int = SEQ_LEN, n: int | None = None,
                        split: str = "train", chunk: int = 4096) -> np.ndarray:
    """Indices of the first ``n`` stories (all if None) with at least ``seq_len`` tokens, in source order.

    Stories are tokenized ``chunk`` at a time, and only until ``n`` long ones are found.

    Returns:
        int64 ``[n]`` (or ``[k]`` for all ``k`` long stories).
    Raises:
        ValueError: no story is long enough, or fewer than ``n`` are.
    """
    stories = list(stories)
    if not stories:
        raise ValueError(f"the {split} split holds no stories")
    if n is not None and n < 1:
        raise ValueError(f"number of windows must be >= 1, got {n}")
    found: list[np.ndarray] = []
    n_found, longest = 0, 0
    for lo in range(0, len(stories), chunk):  # tokenize only as far as needed
        lengths = tokenizer.lengths(stories[lo:lo + chunk])
        longest = max(longest, int(lengths.max()))
        idx = lo + np.flatnonzero(lengths >= seq_len)
        found.append(idx)
        n_found += len(idx)
        if n is not None and n_found >= n:
            break
    long = np.concatenate(found).astype(np.int64)
    if len(long) == 0:
        raise ValueError(f"no {split} story has >= {seq_len} tokens (longest: {longest}); the corpus is too short")
    if n is not None:
        if len(long) < n:
            raise ValueError(f"only {len(long)} of {len(stories)} {split} stories have >= {seq_len} tokens; "
                             f"{n} windows requested")
        long = long[:n]
    return long


def make_windows(feats: StoryFeatures, seq_len: int, rng: np.random.Generator,
                 story_index: np.ndarray | None = None) -> StoryWindows:
    """One window of ``seq_len`` tokens at a random offset in each story of ``feats`` that is long enough.

    Args:
        feats: featurized stories (``S`` of them).
        seq_len: ``T``.
        rng: draws the offsets (one ``rng.integers(0, L - T + 1)`` per long story, in order).
        story_index: int64 ``[S]`` index to report for each story (default ``0..S-1``).
    Returns:
        :class:`StoryWindows` with ``n`` = number of stories with ``L >= T``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    lengths = feats.lengths()
    index = np.arange(feats.n_stories, dtype=np.int64) if story_index is None else np.asarray(story_index)
    keep = np.flatnonzero(lengths >= seq_len)
    if len(keep) == 0:
        raise ValueError(f"no story has >= {seq_len} tokens; the corpus is too short")
    n = len(keep)
    tokens = np.empty((n, seq_len), dtype=np.int64)
    features = np.empty((n, seq_len, len(FEATURE_NAMES)), dtype=np.float32)
    starts = np.empty(n, dtype=np.int64)
    for r, i in enumerate(keep):
        s = int(rng.integers(0, lengths[i] - seq_len + 1))
        starts[r] = s
        tokens[r] = feats.tokens(int(i))[s:s + seq_len]
        features[r] = feats.dense(int(i), s, s + seq_len)
    return StoryWindows(tokens=tokens, features=features, story_index=index[keep].astype(np.int64),
                        start=starts, story_len=lengths[keep].astype(np.int64))


def build_windows(
    stories,
    tokenizer,
    *,
    n_windows: int | None = None,
    seq_len: int = SEQ_LEN,
    seed: int | list[int] = 0,
    featurizer: Featurizer | None = None,
    cache_dir: str | os.PathLike | None = None,
    split: str = "train",
    progress: bool = False,
) -> StoryWindows:
    """Windows of one split: pick the first ``n_windows`` long stories, featurize them (cached), cut windows.

    Args:
        stories: the split's stories.
        tokenizer: a :class:`~ntpflow.tasks.stories.tokenizer.StoryTokenizer`.
        n_windows: number of windows (= stories used); None uses every story with ``>= seq_len`` tokens.
        seq_len: ``T``.
        seed: seeds ``numpy.random.default_rng`` (an int or a list of ints) for the window offsets.
        featurizer: spaCy :class:`~ntpflow.tasks.stories.features.Featurizer` (built if None).
        cache_dir: feature cache folder (None: no cache).
        split: name used in error messages.
        progress: show a progress bar while spaCy runs.
    Returns:
        :class:`StoryWindows` with ``tokens`` int64 ``[n, T]`` and ``features`` float32 ``[n, T, 22]``.
    """
    stories = list(stories)
    idx = select_long_stories(stories, tokenizer, seq_len, n_windows, split=split)
    feats = featurize([stories[i] for i in idx], tokenizer, featurizer=featurizer, cache_dir=cache_dir,
                      progress=progress)
    return make_windows(feats, seq_len, np.random.default_rng(seed), story_index=idx)


def build_story_data(
    corpus: Corpus,
    tokenizer,
    *,
    n_train: int | None = None,
    n_eval: int | None = None,
    seq_len: int = SEQ_LEN,
    seed: int = 0,
    featurizer: Featurizer | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> StoryData:
    """Train and eval windows of ``corpus`` (offsets seeded by ``[seed, 0]`` and ``[seed, 1]``).

    Args:
        corpus: the stories, already split by story.
        tokenizer: the run's tokenizer (see :func:`~ntpflow.tasks.stories.tokenizer.get_tokenizer`).
        n_train, n_eval: windows per split (None: all long stories).
        seq_len: ``T`` (64 in the paper).
        seed: data seed.
        featurizer: shared spaCy featurizer (built once if None).
        cache_dir: feature cache folder.
        progress: show progress bars while spaCy runs.
    """
    featurizer = featurizer if featurizer is not None else Featurizer()
    train = build_windows(corpus.train, tokenizer, n_windows=n_train, seq_len=seq_len, seed=[seed, 0],
                          featurizer=featurizer, cache_dir=cache_dir, split="train", progress=progress)
    held = build_windows(corpus.eval, tokenizer, n_windows=n_eval, seq_len=seq_len, seed=[seed, 1],
                         featurizer=featurizer, cache_dir=cache_dir, split="eval", progress=progress)
    return StoryData(train=train, eval=held, tokenizer=tokenizer, corpus_name=corpus.name)
