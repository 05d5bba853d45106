"""Synthetic next-token tasks with ground-truth features.

Every task yields :class:`Batch` objects whose sequences start with ``<bos>``
at position 0; logits at position ``p`` predict token ``p + 1``.
"""

from __future__ import annotations

from ntpflow.tasks.base import Batch, Task, concat_batches
from ntpflow.tasks.majority import CondMajority, Majority
from ntpflow.tasks.othello import Othello
from ntpflow.tasks.stories.task import Stories

__all__ = ["TASKS", "Batch", "CondMajority", "Majority", "Othello", "Stories", "Task", "concat_batches", "make_task"]

TASKS: dict[str, type] = {
    "majority": Majority,
    "cond_majority": CondMajority,
    "othello": Othello,
    "stories": Stories,
}


def make_task(name: str, **kwargs) -> Task:
    """Build the task registered under ``name`` with constructor ``kwargs``."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}"
        ) from None
    return cls(**kwargs)
