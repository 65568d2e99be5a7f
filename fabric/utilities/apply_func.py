"""Moving and converting whole batches: any nesting of dicts, lists, tuples, namedtuples and dataclasses."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

CPU = torch.device("cpu")
_TENSOR = torch.Tensor  # read on every batch: one global lookup instead of a global and an attribute
# containers apply_to_collection walks into; none of them has a ``.to`` (subclasses may, so exact types only)
_PLAIN_CONTAINERS = frozenset({list, tuple, dict})


def _is_transferable(obj: Any) -> bool:
    return callable(getattr(obj, "to", None)) and not isinstance(obj, type)


class _HasTo(type):
    """A virtual type matching anything with a ``.to(device)`` method (tensors, BatchEncoding-like objects)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if isinstance(obj, torch.Tensor):  # the common leaf, answered without the attribute lookup
            return True
        if type(obj) in _PLAIN_CONTAINERS:
            return False
        return _is_transferable(obj) and not isinstance(obj, torch.nn.Module)


class Transferable(metaclass=_HasTo):
    """Marker for ``apply_to_collection``: every object that can be moved with ``.to(device)``."""


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Return ``batch`` with every tensor (or ``.to``-able object) in it moved to ``device``.

    Containers keep their types (a new container, as ``apply_to_collection`` makes); objects without a
    ``.to`` method are returned as they are.
    """
    if isinstance(device, str):
        device = torch.device(device)
    on_cpu = device == CPU
    if on_cpu:
        moved = as_moved_to_cpu(batch)
        if moved is not None:
            return moved
    # a host->CUDA copy can overlap with compute only when it is non-blocking
    non_blocking = isinstance(device, torch.device) and device.type == "cuda"

    def _move(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if on_cpu and type(obj) is torch.Tensor and obj.is_cpu:
                return obj  # what ``.to`` would return, without its argument parsing
            return obj.to(device, non_blocking=non_blocking)
        moved = obj.to(device)
        # some objects (e.g. BatchEncoding of older libraries) move in place and return None
        return obj if moved is None else moved

    if isinstance(batch, torch.Tensor):
        return _move(batch)
    return apply_to_collection(batch, dtype=Transferable, function=_move)


def as_moved_to_cpu(batch: Any) -> Any:
    """What moving ``batch`` to the CPU gives, when it is a CPU tensor or a flat tuple, list or dict of them;
    else None (then the batch needs the full walk).

    The fast path of a CPU loop: nothing to move, nothing to walk. A list or dict still comes back new, as
    from the walk (the caller may change it); a tensor or tuple comes back as it is. Exact types only (a
    tensor subclass may move differently, a container subclass may be rebuilt differently); ``is_cpu`` is
    the cheapest device test.
    """
    kind = type(batch)
    if kind is _TENSOR:
        return batch if batch.is_cpu else None
    if kind is tuple or kind is list:
        items = batch
    elif kind is dict:
        items = batch.values()
    else:
        return None
    for item in items:
        if type(item) is not _TENSOR or not item.is_cpu:
            return None
    return batch if kind is tuple else kind(batch)


def convert_to_tensors(data: Any, device: torch.device) -> Any:
    """Turn Python/NumPy numbers in ``data`` into tensors on ``device`` (used before collectives)."""
    import numpy as np

    def _number(value: Any) -> torch.Tensor:
        return torch.tensor(value, device=device)

    data = apply_to_collection(data, (int, float, bool, np.number, np.ndarray), _number, wrong_dtype=torch.Tensor)
    return move_data_to_device(data, device)


def convert_tensors_to_scalars(data: Any) -> Any:
    """Turn one-element tensors into Python numbers (used by loggers)."""

    def _item(tensor: torch.Tensor) -> Any:
        if tensor.numel() != 1:
            raise ValueError(f"Only one-element tensors can be turned into numbers, got shape {tuple(tensor.shape)}")
        return tensor.item()

    return apply_to_collection(data, torch.Tensor, _item)
