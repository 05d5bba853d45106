"""Probing a trained run: residuals of its eval set, ridge probes per (layer, position), saved in the run dir."""

import logging
import time

import torch

from ntpflow.files import resolve_device
from ntpflow.model.gpt import GPT
from ntpflow.model.sites import feature_name
from ntpflow.probes import ProbeSet, fit_probes
from ntpflow.progress import duration
from ntpflow.runs.run import Run

log = logging.getLogger(__name__)


@torch.no_grad()
def collect_resid(model: GPT, tokens: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Residual stream of ``tokens`` [n, pos] as [n_layer+1, n, pos, d_model] on the CPU (ordinary forward)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    parts = []
    for s in range(0, len(tokens), chunk):
        _, resid = model(tokens[s:s + chunk].to(device), myopic="none", return_resid=True)
        parts.append(torch.stack(resid).cpu())
    model.train(was_training)
    return torch.cat(parts, dim=1)


def probe_run(run: Run, which: str | int = "final", *, alpha: float = 1.0, train_frac: float = 0.7,
              device: str = "auto") -> ProbeSet:
    """Fit ridge probes for every task feature on the run's eval set with the weights ``which``
    (``"final"``, ``"init"`` = step 0, or a checkpoint step), as the reference does: first 70% fit, last 30% test,
    positions 1..T-1. Saved to ``RUN_DIR/probes`` (final) or ``RUN_DIR/probes_<which>``."""
    model = run.load_model(which, resolve_device(device))
    _, eval_set = run.datasets()
    start = time.monotonic()
    log.info("%s: probing the %s weights on %d eval sequences", run.name, which, len(eval_set.tokens))
    resid = collect_resid(model, torch.as_tensor(eval_set.tokens))
    ft = None if eval_set.feature_types is None else torch.as_tensor(eval_set.feature_types).long()
    probes = fit_probes(resid, torch.as_tensor(eval_set.features), alpha=alpha, train_frac=train_frac,
                        feature_types=ft, feature_names=run.task.feature_names)
    probes.metadata["config_hash"] = run.cfg.hash()
    out = run.probes_dir(which)
    out.mkdir(exist_ok=True)
    probes.save(out)
    log.info("%s: probed the %s weights in %s", run.name, which, duration(time.monotonic() - start))
    return probes


def check_feature(run: Run, name: str) -> str:
    """``name`` as the run's task spells it (:func:`~ntpflow.model.sites.feature_name`); a name the task lacks is a
    one-line ValueError naming some of its features, raised before anything is fitted or written."""
    names = list(run.task.feature_names)
    if feature_name(name) not in names:
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise ValueError(f"unknown feature {name!r}; {run.name}'s task has {shown}")
    return feature_name(name)


def load_or_probe(run: Run, which: str | int = "final", device: str = "auto") -> ProbeSet:
    """The saved probes of ``run`` for weights ``which``, fitting them first if absent."""
    path = run.probes_dir(which)
    if ProbeSet.saved(path):
        return ProbeSet.load(path)
    return probe_run(run, which, device=device)
