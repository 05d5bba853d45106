"""Pretrained LLMs: Q(w) for SAE latents by ablation (docs/paper.md#q, #gemma).

Modules: :mod:`.adapters` (TransformerLens / Hugging Face models behind one protocol, ``load_smollm2``),
:mod:`.sae` (SAE interface, training with sae-lens, quality), :mod:`.corpus` (stories / code / math corpus),
:mod:`.qscan` (top activations, batched ablation KL, Q, statistics), :mod:`.steering` (steering and a code-likeness
score), :mod:`.lens` (look-ahead lens and its overlap with SAE encoders), :mod:`.q_vs_influence` (Q by ablation of toy
probe directions vs the replay's influence), :mod:`.components` (tiny test model, SAE storage), :mod:`.qscan_cli`
(``ntpflow qscan``).

Importing this package needs only torch and numpy; ``transformers``, ``transformer_lens``, ``sae_lens``, ``gguf`` and
``scipy`` are imported when a function needs them.
"""

from .adapters import HFAdapter as HFAdapter
from .adapters import HookNameError as HookNameError
from .adapters import ModelAdapter as ModelAdapter
from .adapters import TLAdapter as TLAdapter
from .adapters import load_smollm2 as load_smollm2
from .corpus import Contexts as Contexts
from .corpus import Document as Document
from .corpus import build_corpus as build_corpus
from .corpus import tokenize_corpus as tokenize_corpus
from .lens import fit_lenses as fit_lenses
from .lens import fit_linear as fit_linear
from .lens import lens_q_correlation as lens_q_correlation
from .lens import overlap as overlap
from .lens import spearman as spearman
from .q_vs_influence import probe_ablation_kl as probe_ablation_kl
from .q_vs_influence import q_vs_influence as q_vs_influence
from .qscan import QScanConfig as QScanConfig
from .qscan import QScanResult as QScanResult
from .qscan import ablation_kl as ablation_kl
from .qscan import q_scan as q_scan
from .qscan import q_statistics as q_statistics
from .qscan import reference_loop_kl as reference_loop_kl
from .qscan import top_activations as top_activations
from .sae import SimpleSAE as SimpleSAE
from .sae import as_sae as as_sae
from .sae import sae_quality as sae_quality
from .sae import train_sae as train_sae
from .steering import code_score as code_score
from .steering import generate as generate
from .steering import steer_latents as steer_latents
from .steering import steering_vectors as steering_vectors
