"""TinyStories as a task of the training loop (docs/paper.md#tinystories): fixed windows of a corpus instead of
sampled sequences.

Unlike the synthetic tasks there is no ``<bos>``: position 0 is the first token of a 64-token window, logits at
position ``p`` predict token ``p + 1`` and every prediction but the last counts in the loss. ``legal`` is None.
Features per token (``ntpflow.tasks.stories.features``): 10 Penn Treebank tags, 10 dependency labels, ``pos_int`` (index
in the story) and ``pos_prop`` (index / story length). ``useful`` marks the syntactic features True and the two
position features False: a documented convention, since usefulness is not defined exactly for natural text.

The corpus and its tokenizer are loaded when the task is built; the tokenizer (trained BPE or the hub's) and the
spaCy features are cached under ``cache_dir`` (default ``$NTPFLOW_CACHE`` or ``~/.cache/ntpflow``), keyed by content.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path

import numpy as np

from ntpflow.tasks.base import Batch, Task
from ntpflow.tasks.stories import FEATURE_GROUPS, FEATURE_NAMES, build_story_data, get_tokenizer, load_corpus

__all__ = ["Stories", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$NTPFLOW_CACHE`` if set, else ``~/.cache/ntpflow``."""
    return Path(os.environ.get("NTPFLOW_CACHE") or Path.home() / ".cache" / "ntpflow")


class Stories(Task):
    """Windows of a story corpus. ``corpus``: a source understood by ``ntpflow.tasks.stories.load_corpus``."""

    name = "stories"
    config_fields = ("corpus", "vocab_size")  # TrainConfig fields passed to the constructor
    first_output_pos = 0

    def __init__(self, corpus: str = "generated", vocab_size: int = 4096, seq_len: int = 64,
                 cache_dir: str | os.PathLike | None = None):
        if not corpus:
            raise ValueError("the stories task needs a corpus (set corpus=PATH, 'sample', 'generated[:N]' or 'hf')")
        self.corpus_source, self.vocab_size_requested, self.seq_len = str(corpus), int(vocab_size), int(seq_len)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.feature_names = tuple(FEATURE_NAMES)
        useful = np.ones(len(FEATURE_NAMES), dtype=bool)
        useful[list(FEATURE_GROUPS["position"])] = False
        self.useful = np.broadcast_to(useful, (self.seq_len, len(useful))).copy()

    @cached_property
    def corpus(self):
        """The corpus of ``corpus_source`` (loaded on first use)."""
        return load_corpus(self.corpus_source)

    @cached_property
    def tokenizer(self):
        """The corpus's tokenizer (cached under ``cache_dir``, keyed by corpus fingerprint and vocabulary size)."""
        key = f"tokenizer-{self.corpus.fingerprint()[:16]}-{self.vocab_size_requested}"
        return get_tokenizer(self.cache_dir / key, self.corpus.train, vocab_size=self.vocab_size_requested)

    @property
    def vocab(self) -> tuple[str, ...]:
        """Token strings by id (each id decoded alone)."""
        tok = self.tokenizer
        return tuple(tok.decode([i]) for i in range(tok.vocab_size))

    def make_datasets(self, n_train: int, n_eval: int, seed: int) -> tuple[Batch, Batch]:
        """Train and eval windows (``n_train`` / ``n_eval`` of them, offsets seeded by ``seed``) as Batches."""
        data = build_story_data(self.corpus, self.tokenizer, n_train=n_train, n_eval=n_eval, seq_len=self.seq_len,
                                seed=seed, cache_dir=self.cache_dir / "features")
        return data.train.to_batch(), data.eval.to_batch()

    def sample(self, n: int, rng: np.random.Generator) -> Batch:
        """Not supported: the task reads a fixed corpus; raises ValueError (use :meth:`make_datasets`)."""
        raise ValueError("the stories task reads a fixed corpus; use make_datasets")

    def save_artifacts(self, run_dir: str | os.PathLike) -> None:
        """Copy the tokenizer into the run directory, so the run documents exactly what it was trained on."""
        self.tokenizer.save(run_dir)
