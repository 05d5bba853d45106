"""Story featurisation throughput (issue 6): BPE tokens per second through ``ntpflow.tasks.stories.featurize``.

What is timed: tokenisation + spaCy (``tok2vec``, ``tagger``, ``parser`` via ``nlp.pipe``) + character-span
alignment of a list of stories, without the cache; spaCy's load time is excluded and reported apart. The target is
10,000 BPE tokens/s (wall clock). CPU time of this process is reported too (with ``--n-process 1`` it measures the
work regardless of other load on a shared machine; with more processes the workers' time is not counted).

Corpus: ``--corpus PATH`` (a TinyStories folder of your own), else the project's generated stories. The tokenizer
is a byte-level BPE (vocabulary 4096) trained on the corpus' train split, as a run makes it
when the hub is out of reach (the 50,257-id hub tokenizer gives somewhat fewer tokens per story, so fewer tokens/s).

Usage:
    python benchmarks/bench_featurize.py [--corpus PATH|generated] [--stories 600] [--batch-size 64]
                                         [--n-process 1] [--repeats 2]

Exits 0 whatever the PASS/FAIL outcome; it only reports.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

TARGET = 10_000.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="generated")
    p.add_argument("--stories", type=int, default=600, help="stories featurised per repeat")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--n-process", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import spacy
    import tokenizers

    from ntpflow.tasks.stories import Featurizer, featurize, load_corpus, train_bpe

    corpus = load_corpus(args.corpus if args.corpus != "generated" else "generated:2000", seed=args.seed)
    t0 = time.perf_counter()
    tok = train_bpe(corpus.train, vocab_size=4096)
    t_bpe = time.perf_counter() - t0
    stories = list(corpus.train[: args.stories])

    t0 = time.perf_counter()
    fz = Featurizer(batch_size=args.batch_size, n_process=args.n_process)
    t_load = time.perf_counter() - t0
    load_start = os.getloadavg()

    walls, cpus, n_tok = [], [], 0
    for _ in range(args.repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        f = featurize(stories, tok, featurizer=fz)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        n_tok = len(f.token_ids)
    load_end = os.getloadavg()
    n_words = sum(len(d) for d in fz.nlp.pipe(stories[:50], disable=fz.disabled))
    n_bpe50 = int(f.story_offsets[min(50, f.n_stories)])

    wall_rate = n_tok / statistics.median(walls)
    best_rate = n_tok / min(walls)
    cpu_rate = n_tok / statistics.median(cpus)
    print(f"corpus       {corpus.name}: {len(stories)} stories, {n_tok:,} BPE tokens "
          f"({n_bpe50 / max(n_words, 1):.2f} BPE tokens per spaCy token)")
    print(f"versions     python {platform.python_version()}, spacy {spacy.__version__}, tokenizers "
          f"{tokenizers.__version__}; {fz.version_key}")
    print(f"setup        BPE training {t_bpe:.2f} s (vocab {tok.vocab_size}), spaCy load {t_load:.2f} s")
    print(f"settings     batch_size {args.batch_size}, n_process {args.n_process}, repeats {args.repeats}")
    print(f"wall         median {statistics.median(walls):.2f} s -> {wall_rate:,.0f} tok/s "
          f"(best {best_rate:,.0f} tok/s)")
    print(f"cpu (self)   median {statistics.median(cpus):.2f} s -> {cpu_rate:,.0f} tok/s per CPU-second")
    print(f"load average at start {tuple(round(x, 2) for x in load_start)}, at end "
          f"{tuple(round(x, 2) for x in load_end)} on {os.cpu_count()} CPUs")
    verdict = "PASS" if wall_rate >= TARGET else "FAIL"
    print(f"featurisation {wall_rate:,.0f} tok/s (wall, median)  target >= {TARGET:,.0f}  {verdict}")


if __name__ == "__main__":
    main()
