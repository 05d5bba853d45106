"""ntpflow: where seemingly useless features in next-token predictors come from.

Layer/position convention: ``resid[0]`` = embeddings, ``resid[k]`` = output of block k-1, ``resid[n_layer]`` =
before the final LayerNorm; logits at position p predict token p+1.
"""

from .config import TrainConfig as TrainConfig, apply_overrides as apply_overrides
from .loss import lm_loss as lm_loss, per_position_loss as per_position_loss
from .model import GPT as GPT, GPTConfig as GPTConfig, split_groups as split_groups
from .probes import ProbeSet as ProbeSet, fit_probes as fit_probes, fit_ridge as fit_ridge
from .sites import Site as Site, parse_sites as parse_sites
from .tasks import Batch as Batch, Task as Task, make_task as make_task
from .training import Run as Run, train as train

__version__ = "0.1.0"
