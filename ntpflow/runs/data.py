"""The data a run trains on: its (train, eval) sets, the order of its batches, and batches as tensors."""

import numpy as np
import torch

from ntpflow.runs.config import TrainConfig
from ntpflow.tasks import TASKS, Batch, Task
from ntpflow.tasks.base import check_batch


def make_datasets(cfg: TrainConfig, task: Task) -> tuple[Batch, Batch]:
    """(train, eval) sets from ``data_seed`` (default ``seed``), by the task's :meth:`~ntpflow.tasks.Task.make_datasets`
    (independent generated streams, or windows of a fixed corpus)."""
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    return task.make_datasets(cfg.n_train, cfg.n_eval, seed)


def check_task(cfg: TrainConfig, task: Task) -> None:
    """Check a task of one's own (not a built-in one) before a run writes anything: the first batch its ``sample``
    draws, or, for a task with its own ``make_datasets`` (a file task), both sets (its size included). A one-line
    ValueError names the task and what is wrong (:func:`~ntpflow.tasks.base.check_batch`); an error raised by the
    task's own code becomes one too."""
    if cfg.task in TASKS:
        return
    seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    own_sets = type(task).make_datasets is not Task.make_datasets
    try:
        batches = (task.make_datasets(cfg.n_train, cfg.n_eval, seed) if own_sets
                   else [task.sample(min(cfg.batch_size, cfg.n_train), np.random.default_rng([seed, 0]))])
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code failing is bad input, told in one line
        call = "make_datasets()" if own_sets else "sample()"
        raise ValueError(f"task {cfg.task}: {call} failed: {type(e).__name__}: {str(e).strip()}") from e
    if own_sets and not (isinstance(batches, tuple | list) and len(batches) == 2):
        raise ValueError(f"task {cfg.task}: make_datasets() must return (train, eval) Batches")
    for batch in batches:
        check_batch(task, batch, cfg.task)


class DataOrder:
    """Indices of the training batch at each step: a fresh permutation per epoch, drop-last, seeded by
    ``(seed, epoch)`` only, so any step's batch can be recomputed (for resuming and replaying)."""

    def __init__(self, seed: int, n_train: int, batch_size: int):
        self.seed, self.n, self.bs = seed, n_train, batch_size
        self.per_epoch = n_train // batch_size
        self._epoch: int = -1
        self._perm: torch.Tensor | None = None

    def __call__(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            state = np.random.SeedSequence([self.seed, 7, epoch]).generate_state(1, dtype=np.uint64)[0]
            gen = torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=gen)
        assert self._perm is not None  # drawn above at the first call: no step is in epoch -1
        return self._perm[i * self.bs:(i + 1) * self.bs]


def to_torch(batch: Batch, device) -> dict[str, torch.Tensor]:
    """The batch's tokens, loss mask and (when the task defines one) legal mask as tensors on ``device``."""
    data = {"tokens": torch.as_tensor(batch.tokens, device=device),
            "loss_mask": torch.as_tensor(batch.loss_mask, device=device)}
    if batch.legal is not None:
        data["legal"] = torch.as_tensor(batch.legal, device=device)
    return data

