"""The story tokenizer: the TinyStories-1M (GPT-Neo BPE) tokenizer from the hub, or a byte-level BPE trained here.

:func:`get_tokenizer` is the entry point for a run: it reuses ``<run_dir>/tokenizer.json`` when present, else gets
the hub tokenizer (``source="hub"``), trains a byte-level BPE on the training stories (``source="bpe"``), or tries
the hub and falls back to training (``source="auto"``), and saves the result to ``run_dir`` so every later step
reuses it.

The trained BPE has ``<|endoftext|>`` as id 0 and the 256 byte symbols after it; stories never contain
``<|endoftext|>`` (they are split on it), so id 0 never occurs in the data. Needs the ``tokenizers`` package
(imported lazily).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ntpflow.files import atomic_write, read_json, write_json
from ntpflow.tasks.stories.corpus import EOT, stories_digest

if TYPE_CHECKING:  # tokenizers is imported lazily at run time (the stories extra)
    from tokenizers import Tokenizer

__all__ = ["HUB_TOKENIZER", "StoryTokenizer", "get_tokenizer", "hub_tokenizer", "train_bpe"]

HUB_TOKENIZER = "roneneldan/TinyStories-1M"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "the stories tokenizer needs the 'tokenizers' package: pip install 'ntpflow[stories]'"
        ) from None
    return tokenizers


@dataclass(frozen=True, eq=False)
class StoryTokenizer:
    """A ``tokenizers.Tokenizer`` with where it came from.

    Attributes:
        tok: the underlying ``tokenizers.Tokenizer``.
        meta: JSON-able description: ``source`` (``"hub"`` or ``"bpe"``) and its parameters.
    """

    tok: Tokenizer
    meta: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding size)."""
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    @property
    def source(self) -> str:
        """Where the tokenizer came from: ``meta["source"]`` (``"hub"`` or ``"bpe"``), else ``"unknown"``."""
        return str(self.meta.get("source", "unknown"))

    def to_json(self) -> str:
        """The tokenizer serialised as a JSON string (the content of ``tokenizer.json``)."""
        return self.tok.to_str()

    @property
    def fingerprint(self) -> str:
        """sha256 hex digest of the canonical JSON of the tokenizer (vocabulary, merges, normalisation, ...)."""
        canon = json.dumps(json.loads(self.tok.to_str()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids int64 ``[L]`` and character spans int64 ``[L, 2]`` (``[start, end)`` into ``text``)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`encode` of each text (no special tokens are added)."""
        out = []
        for enc in self.tok.encode_batch(list(texts), add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            offs = np.asarray(enc.offsets, dtype=np.int64).reshape(len(ids), 2)
            out.append((ids, offs))
        return out

    def lengths(self, texts) -> np.ndarray:
        """Number of tokens of each text, int64 ``[len(texts)]``."""
        return np.asarray([len(e.ids) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)],
                          dtype=np.int64)

    def decode(self, ids) -> str:
        """Text of a sequence of ids."""
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        """The token string of id ``i`` (None if out of range)."""
        return self.tok.id_to_token(int(i))

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_meta.json`` to ``folder`` (atomically); returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / TOKENIZER_FILE, self.to_json())
        write_json(folder / META_FILE, {**self.meta, "fingerprint": self.fingerprint,
                                        "vocab_size": self.vocab_size})
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike) -> StoryTokenizer:
        """Reload a tokenizer written by :meth:`save`; a missing or corrupted file is a one-line error."""
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.exists():
            raise FileNotFoundError(f"missing tokenizer file {path}")
        tk = _tokenizers()
        try:
            tok = tk.Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types
            raise ValueError(f"corrupted tokenizer file {path}: {str(e).splitlines()[0] if str(e) else e!r}") \
                from None
        meta = read_json(folder / META_FILE) if (folder / META_FILE).exists() else {"source": "unknown"}
        out = cls(tok, {k: v for k, v in meta.items() if k not in ("fingerprint", "vocab_size")})
        if "fingerprint" in meta and meta["fingerprint"] != out.fingerprint:
            raise ValueError(f"tokenizer file {path} does not match the fingerprint in {folder / META_FILE}")
        return out


def train_bpe(stories, vocab_size: int = 4096, min_frequency: int = 2) -> StoryTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) on ``stories``.

    Deterministic: the same stories and parameters give the same vocabulary, merges and ids.

    Args:
        stories: the training stories (not empty).
        vocab_size: target vocabulary size including ``<|endoftext|>`` (id 0) and the 256 byte symbols; the trainer
            stops early if the corpus runs out of pairs seen ``min_frequency`` times.
        min_frequency: a pair must occur this often to be merged.
    """
    stories = list(stories)
    if not stories:
        raise ValueError("cannot train a tokenizer on an empty list of stories")
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed 257 (the special token and 256 bytes), got {vocab_size}")
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer=trainer, length=len(stories))
    meta = {"source": "bpe", "requested_vocab_size": vocab_size, "min_frequency": min_frequency,
            "train_stories": len(stories), "train_digest": stories_digest(stories),
            "tokenizers_version": tk.__version__}
    return StoryTokenizer(tok, meta)


def hub_tokenizer(name: str = HUB_TOKENIZER) -> StoryTokenizer:
    """The tokenizer of a hub model (default TinyStories-1M, GPT-Neo BPE with 50,257 ids).

    Reads ``tokenizer.json``, or ``vocab.json`` + ``merges.txt`` when the repo has no ``tokenizer.json``. Raises a
    one-line ``RuntimeError`` when the hub is unreachable (or ``HF_HUB_OFFLINE=1`` and nothing is cached).
    """
    tk = _tokenizers()
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise RuntimeError("the hub tokenizer needs huggingface_hub (pip install huggingface_hub)") from None

    def fetch(fname: str) -> str:
        return hf_hub_download(repo_id=name, filename=fname)

    try:
        try:
            tok = tk.Tokenizer.from_file(fetch("tokenizer.json"))
        except Exception as first:  # re-raised unless the file is missing
            if "EntryNotFound" not in type(first).__name__:
                raise
            bpe = tk.models.BPE.from_file(fetch("vocab.json"), fetch("merges.txt"))
            tok = tk.Tokenizer(bpe)
            tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = tk.decoders.ByteLevel()
    except Exception as e:  # noqa: BLE001 - offline, unreachable, missing file: all one message
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(
            f"cannot get the tokenizer of {name} from the Hugging Face hub ({type(e).__name__}: {msg})"
        ) from None
    return StoryTokenizer(tok, {"source": "hub", "name": name})


def get_tokenizer(
    run_dir: str | os.PathLike,
    train_stories=None,
    *,
    source: str = "auto",
    vocab_size: int = 4096,
    hub_name: str = HUB_TOKENIZER,
) -> StoryTokenizer:
    """The run's tokenizer: reuse ``run_dir/tokenizer.json`` if present, else make one and save it there.

    Args:
        run_dir: folder of the run (created if needed).
        train_stories: the training split; needed only when a BPE is trained.
        source: ``"auto"`` (hub if reachable, else train a BPE), ``"hub"`` (hub or a one-line error) or ``"bpe"``.
        vocab_size: vocabulary size of a trained BPE.
        hub_name: hub model whose tokenizer to use.
    Raises:
        ValueError: the saved tokenizer contradicts the request (another source, vocabulary size or training
            corpus); use another ``run_dir`` or delete the saved one.
    """
    if source not in ("auto", "hub", "bpe"):
        raise ValueError(f"unknown tokenizer source {source!r}; choose 'auto', 'hub' or 'bpe'")
    run_dir = Path(run_dir)
    if (run_dir / TOKENIZER_FILE).exists():
        tok = StoryTokenizer.load(run_dir)
        if source != "auto" and tok.source != source:
            raise ValueError(f"{run_dir / TOKENIZER_FILE} is a {tok.source!r} tokenizer, not {source!r}")
        if tok.source == "bpe":
            if tok.meta.get("requested_vocab_size") != vocab_size:
                raise ValueError(f"{run_dir / TOKENIZER_FILE} was trained with vocab_size "
                                 f"{tok.meta.get('requested_vocab_size')}, not {vocab_size}")
            if train_stories is not None and tok.meta.get("train_digest") != stories_digest(train_stories):
                raise ValueError(f"{run_dir / TOKENIZER_FILE} was trained on other stories than these")
        elif tok.source == "hub" and tok.meta.get("name") != hub_name:
            raise ValueError(f"{run_dir / TOKENIZER_FILE} is the tokenizer of {tok.meta.get('name')}, "
                             f"not {hub_name}")
        return tok
    tok, hub_error = None, None
    if source in ("auto", "hub"):
        try:
            tok = hub_tokenizer(hub_name)
        except RuntimeError as e:
            if source == "hub":
                raise
            hub_error = str(e)
    if tok is None:
        if train_stories is None:
            raise ValueError("training a BPE tokenizer needs the training stories")
        tok = train_bpe(train_stories, vocab_size=vocab_size)
        if hub_error is not None:
            tok.meta["hub_error"] = hub_error  # why the hub tokenizer was not used
    tok.save(run_dir)
    return tok
