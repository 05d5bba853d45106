"""Story corpora behind one interface (docs/paper.md#tinystories).

A :class:`Corpus` holds a ``train`` and an ``eval`` tuple of stories (``str``, stripped, non-empty). It comes from

* the Hugging Face dataset ``roneneldan/TinyStories`` (:func:`load_hf_corpus`; needs the hub, and reads the
  ``TinyStoriesV2-GPT4`` text files that the paper used),
* local files (:func:`read_stories`): text with ``<|endoftext|>`` separators, or JSON lines (one object with a
  ``"text"`` field, or one JSON string, per line),
* a small seeded story grammar of this project's own (:func:`generate_stories`), for tests.

:func:`load_corpus` dispatches on a source string. Nothing here imports spaCy or ``tokenizers``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "EOT",
    "HF_DATASET",
    "HF_FILES",
    "Corpus",
    "generate_corpus",
    "generate_stories",
    "load_corpus",
    "load_hf_corpus",
    "read_stories",
    "split_stories",
]

EOT = "<|endoftext|>"
HF_DATASET = "roneneldan/TinyStories"
# The TinyStories sample shipped as package data (ntpflow/data/tinystories-sample: README with its source and licence,
# CDLA-Sharing-1.0, and SHA256SUMS; in the wheel too) and the SHA-256 of each of its files, checked at every load.
SAMPLE_DIR = Path(str(importlib.resources.files("ntpflow") / "data" / "tinystories-sample"))
SAMPLE_SHA256 = {"train.txt": "bdd6f40c699165c043e2d26cfb1198cb9ea17680f17c02c7b11be20f54819db8",
                 "valid.txt": "0aedb4f4a44a4aed1fc1fd9da75678052cd092195dd8f647248ce2aa184650c1"}
HF_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_TRAIN_NAMES = ("train.txt", "train.jsonl", "train.json", "train.ndjson")
_EVAL_NAMES = tuple(f"{stem}{ext}" for stem in ("valid", "validation", "eval", "test")
                    for ext in (".txt", ".jsonl", ".json", ".ndjson"))


@dataclass(frozen=True)
class Corpus:
    """Stories split by story into train and eval.

    Attributes:
        name: where the stories come from (a path, ``hf:<repo>`` or ``generated:<seed>``).
        train: the training stories, in source order.
        eval: the held-out stories, in source order; no story object is shared with ``train`` by construction
            (the same text may occur in both if the source repeats it).
    """

    name: str
    train: tuple[str, ...]
    eval: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError(f"corpus {self.name} has no training stories")
        if not self.eval:
            raise ValueError(f"corpus {self.name} has no eval stories")

    def split(self, name: str) -> tuple[str, ...]:
        """The stories of split ``"train"`` or ``"eval"``."""
        if name not in ("train", "eval"):
            raise ValueError(f"unknown split {name!r}; choose 'train' or 'eval'")
        return self.train if name == "train" else self.eval

    def fingerprint(self) -> str:
        """sha256 hex digest of both splits' content."""
        return hashlib.sha256(
            (stories_digest(self.train) + stories_digest(self.eval)).encode()
        ).hexdigest()


def stories_digest(stories) -> str:
    """sha256 hex digest of a sequence of stories (order and boundaries matter)."""
    h = hashlib.sha256()
    for s in stories:
        b = s.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# local files


def _iter_text_stories(path: Path, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """Stream the stories of a text file split on ``<|endoftext|>`` (stripped, empty ones dropped)."""
    buf = ""
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = f.read(chunk_chars)
            if not chunk:
                break
            buf += chunk
            parts = buf.split(EOT)
            buf = parts.pop()  # the last part may continue in the next chunk
            for p in parts:
                p = p.strip()
                if p:
                    yield p
    buf = buf.strip()
    if buf:
        yield buf


def _iter_jsonl_stories(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if isinstance(obj, dict):
                text = obj.get("text", obj.get("story"))
            else:
                text = obj
            if not isinstance(text, str):
                raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument type
                    f"{path}:{lineno}: expected a string or an object with a 'text' field")
            text = text.strip()
            if text:
                yield text


def read_stories(path: str | os.PathLike, max_stories: int | None = None) -> list[str]:
    """Read stories from a local file.

    ``*.jsonl``, ``*.json`` and ``*.ndjson`` files are read as JSON lines (each line a JSON string or an object
    with a ``"text"`` (or ``"story"``) field); any other file as UTF-8 text with ``<|endoftext|>`` separators.
    Stories are stripped of surrounding whitespace; empty ones are dropped.

    Args:
        path: the file.
        max_stories: stop after this many stories (the file is streamed, so a prefix of a large file is cheap).
    Returns:
        the stories in file order.
    Raises:
        FileNotFoundError: ``path`` does not exist. ValueError: no story in the file, or a bad JSON line.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist")
    if path.is_dir():
        raise ValueError(f"corpus path {path} is a folder; read_stories needs a file (load_corpus takes folders)")
    if max_stories is not None and max_stories < 1:
        raise ValueError(f"max_stories must be >= 1, got {max_stories}")
    it = _iter_jsonl_stories(path) if path.suffix.lower() in _JSON_SUFFIXES else _iter_text_stories(path)
    out: list[str] = []
    try:
        for s in it:
            out.append(s)
            if max_stories is not None and len(out) >= max_stories:
                break
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise ValueError(f"corpus file {path} holds no stories")
    return out


def split_stories(stories, eval_fraction: float, seed: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split stories into train and eval by story, at random but reproducibly.

    Args:
        stories: sequence of ``S`` stories (``S >= 2``).
        eval_fraction: share of stories held out, in ``(0, 1)``; at least one story goes to each side.
        seed: seed of the permutation that picks the held-out stories.
    Returns:
        ``(train, eval)``, each in the original order.
    """
    stories = list(stories)
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if len(stories) < 2:
        raise ValueError(f"need at least 2 stories to split into train and eval, got {len(stories)}")
    n_eval = min(max(1, round(eval_fraction * len(stories))), len(stories) - 1)
    is_eval = np.zeros(len(stories), dtype=bool)
    is_eval[np.random.default_rng(seed).permutation(len(stories))[:n_eval]] = True
    train = tuple(s for s, e in zip(stories, is_eval) if not e)
    held = tuple(s for s, e in zip(stories, is_eval) if e)
    return train, held


def _find(folder: Path, names: tuple[str, ...]) -> Path | None:
    for n in names:
        if (folder / n).is_file():
            return folder / n
    return None


def load_corpus(
    source: str | os.PathLike,
    *,
    max_stories: int | None = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
) -> Corpus:
    """Load a corpus from a source string.

    Args:
        source: one of
            * ``"hf"`` or ``"hf:<dataset repo>"``: the TinyStories files on the Hugging Face hub
              (:func:`load_hf_corpus`);
            * ``"generated"`` or ``"generated:<n stories>"``: the project's story grammar, seeded by ``seed``;
            * ``"sample"``: the TinyStories sample shipped with the package (:func:`sample_dir`, hash-checked);
            * a folder holding ``train.txt`` (or ``.jsonl``) and optionally ``valid.txt`` / ``validation`` /
              ``eval`` / ``test`` (any of those suffixes);
            * a single file (split by story with ``eval_fraction`` and ``seed``).
        max_stories: read at most this many stories per file (per split for the hub).
        eval_fraction: share held out when only one file (or a folder with only a train file) is given.
        seed: seeds the split (single file) or the generator.
    Returns:
        the corpus.
    """
    src = os.fspath(source)
    if src == "hf" or src.startswith("hf:"):
        return load_hf_corpus(src[3:] or HF_DATASET, max_stories=max_stories)
    if src == "generated" or src.startswith("generated:"):
        n = int(src.split(":", 1)[1]) if ":" in src else 400
        if max_stories is not None:
            n = min(n, max_stories)
        n_eval = max(1, round(eval_fraction * n))
        return generate_corpus(n - n_eval, n_eval, seed=seed)
    path = sample_dir() if src == "sample" else Path(src)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist")
    if path.is_dir():
        train_file = _find(path, _TRAIN_NAMES)
        if train_file is None:
            raise FileNotFoundError(
                f"corpus folder {path} has no {' / '.join(_TRAIN_NAMES[:2])}")
        eval_file = _find(path, _EVAL_NAMES)
        if eval_file is not None:
            return Corpus(str(path), tuple(read_stories(train_file, max_stories)),
                          tuple(read_stories(eval_file, max_stories)))
        path = train_file
    train, held = split_stories(read_stories(path, max_stories), eval_fraction, seed)
    return Corpus(str(path), train, held)


def sample_dir(folder: Path | None = None, hashes: dict[str, str] = SAMPLE_SHA256) -> Path:
    """The shipped TinyStories sample's folder (``folder``, default :data:`SAMPLE_DIR`, the package data
    ``ntpflow/data/tinystories-sample`` found by :mod:`importlib.resources`), after checking each file against its
    pinned SHA-256; a missing folder (a package built without its data) or a changed file is a one-line error."""
    folder = SAMPLE_DIR if folder is None else folder
    if not folder.is_dir():
        raise FileNotFoundError(f"the TinyStories sample ships in the ntpflow package (ntpflow/data/tinystories-sample), "
                                f"not found at {folder}; reinstall ntpflow, or pass a corpus: a folder, 'hf' or "
                                "'generated:N'")
    for name, want in hashes.items():
        try:
            got = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        except FileNotFoundError:
            raise FileNotFoundError(f"the TinyStories sample {folder} lacks {name}") from None
        if got != want:
            raise ValueError(f"the TinyStories sample {folder / name} does not match its SHA-256 ({got[:12]}…, "
                             f"expected {want[:12]}…): restore it from the repository or reinstall ntpflow")
    return folder


def load_hf_corpus(
    repo: str = HF_DATASET,
    *,
    files: tuple[str, str] = HF_FILES,
    max_stories: int | None = None,
) -> Corpus:
    """TinyStories from the Hugging Face hub: the ``TinyStoriesV2-GPT4`` train and valid text files (as the paper).

    Uses ``huggingface_hub`` (its cache, so an earlier download also works offline). Raises a one-line
    ``RuntimeError`` when the hub is unreachable (or ``HF_HUB_OFFLINE=1`` and the files are not cached), pointing
    to local files instead.

    Args:
        repo: dataset repository.
        files: ``(train file, eval file)`` inside it.
        max_stories: read at most this many stories of each file.
    """
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise RuntimeError(
            "loading TinyStories from the hub needs huggingface_hub (pip install huggingface_hub); "
            "or pass a local file or folder as the corpus"
        ) from None
    paths = []
    for fname in files:
        try:
            paths.append(hf_hub_download(repo_id=repo, filename=fname, repo_type="dataset"))
        except Exception as e:  # noqa: BLE001 - offline, unreachable, gated, missing file: all one message
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise RuntimeError(
                f"cannot get {fname} of dataset {repo} from the Hugging Face hub ({type(e).__name__}: {msg}); "
                f"pass a local corpus instead (text with {EOT} separators, or JSON lines)"
            ) from None
    return Corpus(f"hf:{repo}", tuple(read_stories(paths[0], max_stories)),
                  tuple(read_stories(paths[1], max_stories)))


# ---------------------------------------------------------------------------------------------------------------
# the project's own story grammar

_GIRLS = ("Lily", "Mia", "Anna", "Sue", "Lucy", "Zoe")
_BOYS = ("Tom", "Ben", "Sam", "Max", "Tim", "Jack")
_ANIMALS = ("dog", "cat", "bird", "fish", "frog", "bunny", "duck", "bear", "mouse", "fox")
_THINGS = ("ball", "kite", "box", "toy", "hat", "book", "cake", "car", "boat", "flower", "tree", "rock")
_PLACES = ("park", "garden", "house", "forest", "lake", "school", "yard", "shop")
_ADJS = ("big", "small", "red", "happy", "sad", "shiny", "soft", "little", "funny", "kind", "tall", "blue")
_FEELINGS = ("happy", "sad", "scared", "proud", "tired", "excited", "sorry", "brave")
_VERBS_PAST = ("found", "saw", "liked", "took", "wanted", "made", "lost", "shared", "hugged", "painted")
_VERBS_BASE = ("play", "run", "jump", "sing", "dance", "swim", "read", "hide", "help", "look")
_ADVS = ("slowly", "quickly", "happily", "quietly", "again", "together", "very fast", "all day")
_EXCLAIMS = ("Wow", "Look", "Oh no", "Yay", "Hello", "Please", "Thank you")
_FRIENDS = ("mom", "dad", "friend", "sister", "brother", "teacher")


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


# body sentences: ``{name}``, ``{pron}``/``{pron_l}``, ``{poss}``/``{poss_l}`` (the character), ``{subj}`` (name or
# pronoun) and ``{a} {n} {t} {p}`` (an adjective, animal, thing and place) are drawn once per sentence; every other
# field draws afresh from its word list where it stands, left to right
_BODY_SENTENCES = (
    "One day, {pron_l} went to the {p} with {poss_l} {friend}.",
    "{subj} {past} a {a} {t} near the {p}.",
    "The {n} was very {feeling}, and it did not want to {base}.",
    '{name} said, "{exclaim}! Can I {base} with the {a} {t}?"',
    "{subj} and the {n} liked to {base} {adv}.",
    "Then {pron_l} {past} {poss_l} {t} and felt {feeling}.",
    "In the {p}, there was a {a} {n} who could {base}.",
    "{poss} {friend} smiled and gave {name} a {a} {t}.",
    "{subj} didn't know why the {t} was so {a}, but {pron_l} was {feeling}.",
    "They {past} the {t} {adv} because it was {a}.",
)
_FRESH_WORDS = {"friend": _FRIENDS, "past": _VERBS_PAST, "base": _VERBS_BASE, "feeling": _FEELINGS,
                "exclaim": _EXCLAIMS, "adv": _ADVS}


class _SentenceFields(dict):
    """The fields of one body sentence; a missing one is a fresh draw from its word list (``_FRESH_WORDS``)."""

    def __init__(self, rng: np.random.Generator, **fields: str):
        super().__init__(fields)
        self.rng = rng

    def __missing__(self, key: str) -> str:
        return _pick(self.rng, _FRESH_WORDS[key])


def _body_sentence(rng: np.random.Generator, name: str, pron: str, poss: str) -> str:
    k = int(rng.integers(len(_BODY_SENTENCES)))
    a, n, t, p = _pick(rng, _ADJS), _pick(rng, _ANIMALS), _pick(rng, _THINGS), _pick(rng, _PLACES)
    subj = name if rng.random() < 0.5 else pron
    return _BODY_SENTENCES[k].format_map(_SentenceFields(rng, name=name, pron=pron, pron_l=pron.lower(), poss=poss,
                                                         poss_l=poss.lower(), subj=subj, a=a, n=n, t=t, p=p))


def generate_stories(n: int, seed: int, min_sentences: int = 2, max_sentences: int = 14) -> list[str]:
    """Stories from a small grammar of simple sentences, for tests (not a stand-in for TinyStories' statistics).

    Every story starts with an opening sentence that introduces a named character and has
    ``min_sentences..max_sentences`` sentences in all, in 1-3 paragraphs; short ones (under 64 BPE tokens)
    occur on purpose, so that the length filter is exercised.

    Args:
        n: number of stories.
        seed: seeds ``numpy.random.default_rng``; the same seed gives the same stories.
    Returns:
        ``n`` stories.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_sentences <= max_sentences:
        raise ValueError("need 1 <= min_sentences <= max_sentences")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        girl = bool(rng.random() < 0.5)
        name = _pick(rng, _GIRLS if girl else _BOYS)
        pron, poss = ("She", "Her") if girl else ("He", "His")
        opening = (f"Once upon a time, there was a {_pick(rng, _ADJS)} "
                   f"{_pick(rng, ('girl', 'kid') if girl else ('boy', 'kid'))} named {name}.")
        k = int(rng.integers(min_sentences, max_sentences + 1))
        sents = [opening] + [_body_sentence(rng, name, pron, poss) for _ in range(k - 1)]
        cuts = sorted({int(c) for c in rng.integers(1, max(2, k), size=int(rng.integers(0, 3)))})
        paras, prev = [], 0
        for c in cuts + [k]:
            if c > prev:
                paras.append(" ".join(sents[prev:c]))
                prev = c
        out.append("\n".join(paras))
    return out


def generate_corpus(n_train: int = 360, n_eval: int = 40, seed: int = 0) -> Corpus:
    """A generated :class:`Corpus`: the first ``n_train`` of ``generate_stories(n_train + n_eval, seed)`` train, the rest eval."""
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"need n_train >= 1 and n_eval >= 1, got {n_train}, {n_eval}")
    stories = generate_stories(n_train + n_eval, seed)
    return Corpus(f"generated:{seed}", tuple(stories[:n_train]), tuple(stories[n_train:]))
