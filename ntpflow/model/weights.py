"""Checking a file's tensors against a model's, tensor by tensor, with a one-line error naming the first bad one."""

from collections.abc import Mapping

import torch


def check_tensors(shapes: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise ValueError (one line) unless ``tensors`` ({name: tensor}) holds exactly the names of ``shapes`` ({name:
    the model's shape}), each in its shape, all of one floating dtype. ``where`` names the file in the message.

    The first bad tensor is named: a foreign name (in the file's order), then a missing one, a wrong shape or a
    dtype (in the model's order)."""
    foreign = [k for k in tensors if k not in shapes]
    if foreign:
        sample = ", ".join(list(shapes)[:3])
        raise ValueError(f"{where}: tensor {foreign[0]!r} is not one of the model's ({len(foreign)} such; the model's "
                         f"are named like {sample})")
    dtype = None
    for name, shape in shapes.items():
        if name not in tensors:
            raise ValueError(f"{where}: tensor {name!r} is missing ({len(shapes) - len(tensors)} of the model's "
                             f"{len(shapes)} are)")
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {list(t.shape)}; the model's is {list(shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{where}: tensor {name!r} has dtype {t.dtype}, not a floating-point type")
        dtype = dtype or t.dtype
        if t.dtype != dtype:
            raise ValueError(f"{where}: tensor {name!r} has dtype {t.dtype}; the ones before it are {dtype}")


def shapes_of(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the model's state dict (what :func:`check_tensors` compares a file with)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
