"""ntpflow: where seemingly useless features in next-token predictors come from.

Layer/position convention: ``resid[0]`` = embeddings, ``resid[k]`` = output of block k-1, ``resid[n_layer]`` =
before the final LayerNorm; logits at position p predict token p+1.
"""

from .config import TrainConfig as TrainConfig
from .config import apply_overrides as apply_overrides
from .loss import lm_loss as lm_loss
from .loss import per_position_loss as per_position_loss
from .model import GPT as GPT
from .model import GPTConfig as GPTConfig
from .model import split_groups as split_groups
from .probes import ProbeSet as ProbeSet
from .probes import fit_probes as fit_probes
from .probes import fit_ridge as fit_ridge
from .sites import Site as Site
from .sites import parse_sites as parse_sites
from .tasks import Batch as Batch
from .tasks import Task as Task
from .tasks import make_task as make_task
from .training import Run as Run
from .training import train as train

__version__ = "0.1.0"
