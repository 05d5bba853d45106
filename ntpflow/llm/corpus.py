"""A small corpus with a known domain per text: ``stories``, ``code`` and ``math``.

* stories: the TinyStories sample in a folder (``train.txt``/``valid.txt``, stories separated by lines holding
  ``<|endoftext|>``), or, without one, simple generated stories;
* code: Python source of the installed standard library, cut into pieces at line boundaries;
* math: generated arithmetic and algebra text.

Everything is seeded; nothing is downloaded. Domains of one's own (:func:`user_documents`) replace these three:
``{label: a text file (documents separated by blank lines) or a folder of .txt files (one document each)}``, with
the labels that count as formal given by the user (:class:`Contexts` keeps both).
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ntpflow.files import load_tensors, read_json, save_tensors, sidecar

DOMAINS = ("stories", "code", "math")
FORMAL_DOMAINS = ("code", "math")


@dataclass(frozen=True)
class Document:
    """A text with its domain (one of :data:`DOMAINS`, or a label of one's own)."""

    text: str
    domain: str


# ----------------------------------------------------------------------------------------------------------- stories

_NAMES = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max", "Anna", "Sam", "Lucy", "Tim"]
_ANIMALS = ["cat", "dog", "bird", "bunny", "frog", "duck", "bear", "fish"]
_PLACES = ["park", "garden", "forest", "beach", "farm", "house", "lake", "hill"]
_THINGS = ["ball", "kite", "box", "hat", "toy car", "red apple", "book", "shiny stone"]
_FEELINGS = ["happy", "sad", "scared", "excited", "tired", "proud"]


def generate_stories(n: int, seed: int) -> list[Document]:
    """``n`` short template stories (used when no TinyStories folder is available)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.sample(_NAMES, 2)
        animal, place, thing = rng.choice(_ANIMALS), rng.choice(_PLACES), rng.choice(_THINGS)
        f1, f2 = rng.sample(_FEELINGS, 2)
        s = [f"Once upon a time, there was a little {animal} named {a}.",
             f"{a} liked to play in the {place} with {b}.",
             f"One day, {a} found a {thing} under a big tree.",
             f"{a} felt {f1} and showed the {thing} to {b}.",
             f'"Can we play with it together?" asked {b}.',
             f'"Yes!" said {a}. They played all day and {b} was very {f2}.',
             f"When the sun went down, they went home. {a} knew that sharing is good."]
        if rng.random() < 0.5:
            s.insert(4, f"But then the {thing} fell into the {rng.choice(['water', 'mud', 'grass'])}.")
        docs.append(Document(" ".join(s), "stories"))
    return docs


def story_documents(n: int, seed: int, path: str | None = None) -> list[Document]:
    """``n`` stories: sampled (seeded) from the TinyStories files in ``path`` if it exists, otherwise generated."""
    texts: list[str] = []
    if path and os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith(".txt"):
                with open(os.path.join(path, name), encoding="utf-8") as fh:
                    texts += [t.strip() for t in fh.read().split("<|endoftext|>") if len(t.strip()) > 200]
    if not texts:
        return generate_stories(n, seed)
    rng = random.Random(seed)
    picks = rng.sample(range(len(texts)), min(n, len(texts)))
    return [Document(texts[i], "stories") for i in picks]


# -------------------------------------------------------------------------------------------------------------- code


def stdlib_python_files(root: str | None = None) -> list[str]:
    """Sorted paths of ``.py`` files of the installed standard library (tests and site-packages excluded)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "test", "tests",
                                                        "idlelib", "__pycache__", "lib2to3"))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def code_documents(n: int, seed: int, chars: int = 1200, root: str | None = None) -> list[Document]:
    """``n`` pieces of about ``chars`` characters of standard-library Python source, cut at line boundaries, from
    seeded random files and offsets (the first 40 lines of each file, mostly licence text and docstrings, skipped)."""
    files = stdlib_python_files(root)
    if not files:
        raise FileNotFoundError("no standard-library Python files found")
    rng = random.Random(seed)
    docs: list[Document] = []
    tries = 0
    while len(docs) < n and tries < 50 * n:
        tries += 1
        try:
            with open(rng.choice(files), encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) < 80:
            continue
        start = rng.randrange(40, len(lines) - 20)
        piece, size = [], 0
        for line in lines[start:]:
            piece.append(line)
            size += len(line) + 1
            if size >= chars:
                break
        text = "\n".join(piece)
        if len(text.strip()) > chars // 2:
            docs.append(Document(text, "code"))
    return docs


# -------------------------------------------------------------------------------------------------------------- math


def _math_item(rng: random.Random) -> str:
    kind = rng.randrange(6)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    if kind == 0:
        op = rng.choice("+-*")
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a} {op} {b} = {val}."
    if kind == 1:
        x = rng.randint(-20, 20)
        return (f"Solve for x: {c}x + {a} = {c * x + a}. Subtract {a} from both sides: {c}x = {c * x}. "
                f"Divide both sides by {c}: x = {x}.")
    if kind == 2:
        return f"Compute ({a} + {b}) * {c}. First {a} + {b} = {a + b}, then {a + b} * {c} = {(a + b) * c}."
    if kind == 3:
        return f"Let f(x) = {c}x^2 + {a}. Then f({b % 10}) = {c} * {(b % 10) ** 2} + {a} = {c * (b % 10) ** 2 + a}."
    if kind == 4:
        g = rng.randint(2, 9)
        return (f"Simplify the fraction {a * g}/{b * g}. Both numbers are divisible by {g}, so "
                f"{a * g}/{b * g} = {a}/{b}.")
    y = rng.randint(1, 9)
    return (f"If {c}y - {a} = {c * y - a}, then {c}y = {c * y} and y = {y}. Check: {c} * {y} - {a} = {c * y - a}.")


def math_documents(n: int, seed: int, items: int = 8) -> list[Document]:
    """``n`` texts of ``items`` generated arithmetic/algebra statements each."""
    rng = random.Random(seed)
    return [Document(" ".join(_math_item(rng) for _ in range(items)), "math") for _ in range(n)]


# ------------------------------------------------------------------------------------------------------------ corpus


def user_documents(domains: dict[str, str], n: int, seed: int) -> list[Document]:
    """Up to ``n`` documents per label of ``domains`` ({label: path}), a seeded sample in file order: a file holds
    documents separated by blank lines (or by lines holding ``<|endoftext|>``), a folder one document per ``.txt``
    file. FileNotFoundError / ValueError (one line) on a missing path or a domain without text."""
    rng, docs = random.Random(seed), []

    def read(label: str, file: str) -> str:
        try:
            with open(file, encoding="utf-8") as fh:
                return fh.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"domain {label!r}: {file} is not UTF-8 text ({e.reason} at byte {e.start})") from None

    for label, path in domains.items():
        if os.path.isdir(path):
            texts = [read(label, os.path.join(path, name)).strip()
                     for name in sorted(os.listdir(path)) if name.endswith(".txt")]
        elif os.path.isfile(path):
            raw = read(label, path).replace("\r\n", "\n")
            texts = [t.strip() for chunk in raw.split("<|endoftext|>") for t in re.split(r"\n\s*\n", chunk)]
        else:
            raise FileNotFoundError(f"domain {label!r}: {path} does not exist")
        texts = [t for t in texts if t]
        if not texts:
            what = "no .txt file with text" if os.path.isdir(path) else "no text"
            raise ValueError(f"domain {label!r}: {path} holds {what}")
        picks = sorted(rng.sample(range(len(texts)), min(n, len(texts))))
        docs += [Document(texts[i], label) for i in picks]
    return docs


def build_corpus(n_per_domain: int, seed: int, stories_path: str | None = None) -> list[Document]:
    """``n_per_domain`` documents of each domain (stories, code, math), in that order."""
    return (story_documents(n_per_domain, seed, stories_path) + code_documents(n_per_domain, seed + 1)
            + math_documents(n_per_domain, seed + 2))


@dataclass
class Contexts:
    """Fixed-length token windows with their domain.

    Attributes:
        tokens: ``[N, L]`` int64; column 0 is the BOS id.
        domains: domain name of each row (length N).
        doc_index: index of the source document of each row (length N).
        domain_names: every domain, in order (default: :data:`DOMAINS` when the rows use only those, else the
            labels in order of first appearance).
        formal: the domains that count as formal (default :data:`FORMAL_DOMAINS`, those present).
    """

    tokens: torch.Tensor
    domains: list[str]
    doc_index: list[int]
    domain_names: tuple[str, ...] | None = None
    formal: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.domain_names is None:
            self.domain_names = DOMAINS if set(self.domains) <= set(DOMAINS) else tuple(dict.fromkeys(self.domains))
        self.domain_names = tuple(self.domain_names)
        if self.formal is None:
            self.formal = tuple(d for d in FORMAL_DOMAINS if d in self.domain_names)
        self.formal = tuple(self.formal)
        unknown = sorted((set(self.domains) | set(self.formal)) - set(self.domain_names))
        if unknown:
            raise ValueError(f"domain(s) {unknown} are not among the corpus's domains {list(self.domain_names)}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def domain_ids(self) -> torch.Tensor:
        """``[N]`` int64 index into :attr:`domain_names`."""
        assert self.domain_names is not None  # set by __post_init__
        return torch.tensor([self.domain_names.index(d) for d in self.domains], dtype=torch.long)

    def save(self, path: str | Path) -> None:
        """Save to ``path`` (``.safetensors``: ``tokens`` ``[N, L]``, ``domain`` ``[N]`` (index into
        :attr:`domain_names`), ``doc_index`` ``[N]``) and its JSON sidecar (the domain names, the formal ones and
        the file's checksum)."""
        assert self.domain_names is not None and self.formal is not None  # set by __post_init__
        save_tensors(path, {"tokens": self.tokens, "domain": self.domain_ids(),
                            "doc_index": torch.tensor(self.doc_index, dtype=torch.long)},
                     {"domains": list(self.domain_names), "formal": list(self.formal)})

    @classmethod
    def load(cls, path: str | Path) -> Contexts:
        """The windows saved by :meth:`save` (checked against the sidecar's checksum)."""
        t = load_tensors(path)
        meta = read_json(sidecar(path))
        names = meta["domains"]
        return cls(t["tokens"], [names[i] for i in t["domain"].tolist()], t["doc_index"].tolist(), tuple(names),
                   tuple(meta.get("formal", [d for d in FORMAL_DOMAINS if d in names])))


def tokenize_corpus(docs: Sequence[Document], encode: Callable[[str], list[int]], ctx_len: int, bos_id: int,
                    max_windows_per_doc: int = 2, formal: Sequence[str] | None = None) -> Contexts:
    """Cut each document into non-overlapping windows of ``ctx_len - 1`` tokens and prepend ``bos_id``.

    Args:
        docs: the documents.
        encode: text -> token ids, without special tokens.
        ctx_len: window length including BOS.
        bos_id: the id put in column 0.
        max_windows_per_doc: at most this many windows per document (shorter tails are dropped).
        formal: the domains that count as formal (default: those of :data:`FORMAL_DOMAINS`).

    Returns:
        :class:`Contexts` with ``tokens`` ``[N, ctx_len]``.
    """
    rows, domains, index = [], [], []
    w = ctx_len - 1
    for i, d in enumerate(docs):
        ids = list(encode(d.text))
        for j in range(min(max_windows_per_doc, len(ids) // w)):
            rows.append([bos_id] + ids[j * w:(j + 1) * w])
            domains.append(d.domain)
            index.append(i)
    if not rows:
        raise ValueError(f"no document has {w} tokens")
    names = tuple(dict.fromkeys(d.domain for d in docs))
    names = DOMAINS if set(names) <= set(DOMAINS) else names
    missing = [n for n in names if n not in domains] if names != DOMAINS else []
    if missing:
        raise ValueError(f"no document of domain(s) {missing} has {w} tokens (--ctx-len {ctx_len} is too long)")
    return Contexts(torch.tensor(rows, dtype=torch.long), domains, index, names,
                    None if formal is None else tuple(formal))


def hf_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``text -> ids`` for a Hugging Face tokenizer, without special tokens."""
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
