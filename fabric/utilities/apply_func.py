"""Moving and converting whole batches: any nesting of dicts, lists, tuples, namedtuples and dataclasses."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


def _is_transferable(obj: Any) -> bool:
    return callable(getattr(obj, "to", None)) and not isinstance(obj, type)


class _HasTo(type):
    """A virtual type matching anything with a ``.to(device)`` method (tensors, BatchEncoding-like objects)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return _is_transferable(obj) and not isinstance(obj, torch.nn.Module)


class Transferable(metaclass=_HasTo):
    """Marker for ``apply_to_collection``: every object that can be moved with ``.to(device)``."""


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Return ``batch`` with every tensor (or ``.to``-able object) in it moved to ``device``.

    Containers keep their types; objects without a ``.to`` method are returned as they are.
    """
    if isinstance(device, str):
        device = torch.device(device)
    # a host->CUDA copy can overlap with compute only when it is non-blocking
    non_blocking = isinstance(device, torch.device) and device.type == "cuda"

    def _move(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(device, non_blocking=non_blocking)
        moved = obj.to(device)
        # some objects (e.g. BatchEncoding of older libraries) move in place and return None
        return obj if moved is None else moved

    if isinstance(batch, torch.Tensor):
        return _move(batch)
    return apply_to_collection(batch, dtype=Transferable, function=_move)


def all_plain_cpu_tensors(obj: Any) -> bool:
    """Whether ``obj`` is a CPU tensor or a flat tuple/list of them: a batch with nothing to move.

    Exact types only (a tensor subclass may move differently); ``is_cpu`` is the cheapest device test.
    """
    kind = type(obj)
    if kind is torch.Tensor:
        return obj.is_cpu
    if kind is tuple or kind is list:
        for item in obj:
            if type(item) is not torch.Tensor or not item.is_cpu:
                return False
        return True
    return False


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
