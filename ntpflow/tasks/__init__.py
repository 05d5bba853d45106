"""Synthetic next-token tasks with ground-truth features.

Every task yields :class:`Batch` objects whose sequences start with ``<bos>``
at position 0; logits at position ``p`` predict token ``p + 1``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

from ntpflow.tasks.base import Batch, Task, concat_batches
from ntpflow.tasks.file import PREFIX as FILE_PREFIX
from ntpflow.tasks.file import FileTask
from ntpflow.tasks.majority import CondMajority, Majority
from ntpflow.tasks.othello import Othello
from ntpflow.tasks.stories.task import Stories

__all__ = ["TASKS", "Batch", "CondMajority", "FileTask", "Majority", "Othello", "Stories", "Task", "concat_batches", "make_task", "task_class"]

TASKS: Mapping[str, type[Task]] = MappingProxyType({
    "majority": Majority,
    "cond_majority": CondMajority,
    "othello": Othello,
    "stories": Stories,
})  # the built-in tasks; a task of one's own is named by its import path


def task_class(name: str) -> type[Task]:
    """The task class named ``name``: a built-in task (``TASKS``), an import path ``package.module:Class`` of a
    ``Task`` subclass, or ``file:PATH``, a task read from a file (:class:`FileTask`; docs/tasks.md). ValueError (one line) if it cannot be found or is not a task."""
    if name.startswith(FILE_PREFIX):
        return FileTask
    if ":" not in name:
        try:
            return TASKS[name]
        except KeyError:
            raise ValueError(f"unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}, "
                             "or give a task's import path package.module:Class") from None
    module_name, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import task {name!r}: {e}; is the folder that holds it on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 - importing runs the module's code: any error there is the user's input
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        kind = "" if isinstance(e, ImportError | AttributeError | ValueError) else f"{type(e).__name__}: "
        raise ValueError(f"cannot import task {name!r}: {kind}{text}") from None
    if not (isinstance(obj, type) and Task in obj.__mro__):
        raise ValueError(f"{name!r} is not an ntpflow task: {name} must subclass ntpflow.Task (docs/tasks.md)")
    return obj


def make_task(name: str, **kwargs) -> Task:
    """Build the task ``name`` (see :func:`task_class`) with constructor ``kwargs``; ``file:PATH`` reads the file."""
    if name.startswith(FILE_PREFIX):
        return FileTask(name.removeprefix(FILE_PREFIX), **kwargs)
    return task_class(name)(**kwargs)
