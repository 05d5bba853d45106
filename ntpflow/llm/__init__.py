"""Pretrained LLMs: Q(w) for SAE latents by ablation (docs/paper.md#q, #gemma).

Modules: :mod:`.adapters` (TransformerLens / Hugging Face models behind one protocol; loading SmolLM2, gemma or
the tiny test model), :mod:`.sae` (SAE interface, training, quality, storage), :mod:`.corpus` (stories / code / math
corpus), :mod:`.qscan` (top activations, batched ablation KL, Q, statistics), :mod:`.stages` (corpus, SAE, scan: the
stages of ``ntpflow qscan`` and ``ntpflow reproduce llm``), :mod:`.steering` (steering and a code-likeness score),
:mod:`.lens` (look-ahead lens and its overlap with SAE encoders), :mod:`.qscan_cli` (``ntpflow qscan [train|scan]``).

Importing this package needs only torch and numpy; ``transformers``, ``transformer_lens``, ``sae_lens``, ``gguf`` and
``scipy`` are imported when a function needs them.
"""

from ntpflow.llm.adapters import HFAdapter as HFAdapter
from ntpflow.llm.adapters import HookNameError as HookNameError
from ntpflow.llm.adapters import ModelAdapter as ModelAdapter
from ntpflow.llm.adapters import TLAdapter as TLAdapter
from ntpflow.llm.adapters import load_smollm2 as load_smollm2
from ntpflow.llm.corpus import Contexts as Contexts
from ntpflow.llm.corpus import Document as Document
from ntpflow.llm.corpus import build_corpus as build_corpus
from ntpflow.llm.corpus import tokenize_corpus as tokenize_corpus
from ntpflow.llm.lens import fit_lenses as fit_lenses
from ntpflow.llm.lens import fit_linear as fit_linear
from ntpflow.llm.lens import lens_q_correlation as lens_q_correlation
from ntpflow.llm.lens import overlap as overlap
from ntpflow.llm.qscan import QScanConfig as QScanConfig
from ntpflow.llm.qscan import QScanResult as QScanResult
from ntpflow.llm.qscan import ablation_kl as ablation_kl
from ntpflow.llm.qscan import q_scan as q_scan
from ntpflow.llm.qscan import q_statistics as q_statistics
from ntpflow.llm.qscan import reference_loop_kl as reference_loop_kl
from ntpflow.llm.qscan import top_activations as top_activations
from ntpflow.llm.sae import SimpleSAE as SimpleSAE
from ntpflow.llm.sae import as_sae as as_sae
from ntpflow.llm.sae import sae_quality as sae_quality
from ntpflow.llm.sae import train_sae as train_sae
from ntpflow.llm.steering import code_score as code_score
from ntpflow.llm.steering import generate as generate
from ntpflow.llm.steering import steer_latents as steer_latents
from ntpflow.llm.steering import steering_vectors as steering_vectors
from ntpflow.stats import spearman as spearman
