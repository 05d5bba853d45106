"""ntpflow: where seemingly useless features in next-token predictors come from.

Layer/position convention: ``resid[0]`` = embeddings, ``resid[k]`` = output of block k-1, ``resid[n_layer]`` =
before the final LayerNorm; logits at position p predict token p+1.
"""

from ntpflow.engine.decomposition import decompose as decompose
from ntpflow.experiments.run_report import Attribution as Attribution
from ntpflow.experiments.run_report import attribute as attribute
from ntpflow.files import VERSION
from ntpflow.model.config import GPTConfig as GPTConfig
from ntpflow.model.config import split_groups as split_groups
from ntpflow.model.gpt import GPT as GPT
from ntpflow.model.loss import lm_loss as lm_loss
from ntpflow.model.loss import per_position_loss as per_position_loss
from ntpflow.model.sites import Site as Site
from ntpflow.model.sites import parse_sites as parse_sites
from ntpflow.probes import ProbeSet as ProbeSet
from ntpflow.probes import fit_probes as fit_probes
from ntpflow.probes import fit_ridge as fit_ridge
from ntpflow.replay.loop_account import Account as Account
from ntpflow.replay.loop_account import AccountResult as AccountResult
from ntpflow.replay.spec import AttributionSpec as AttributionSpec
from ntpflow.runs.account import AccountSpec as AccountSpec
from ntpflow.runs.config import TrainConfig as TrainConfig
from ntpflow.runs.config import apply_overrides as apply_overrides
from ntpflow.runs.run import Run as Run
from ntpflow.runs.training import train as train
from ntpflow.tasks import Batch as Batch
from ntpflow.tasks import Task as Task
from ntpflow.tasks import make_task as make_task
from ntpflow.tasks import task_class as task_class

__version__ = VERSION
