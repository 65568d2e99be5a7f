"""Creating modules without paying for their weight initialization (``init_module(empty_init=True)``), and giving
the tensors of a module made on the meta device real memory afterwards (``_materialize_meta_tensors``)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class EmptyInit(TorchFunctionMode):
    """Inside this mode ``torch.nn.init`` functions return their tensor untouched.

    Worth it when the weights are about to be overwritten by a checkpoint: initializing a large model
    can take longer than loading it.
    """

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.enabled and getattr(func, "__module__", None) == "torch.nn.init":
            if "tensor" in kwargs:
                return kwargs["tensor"]
            return args[0]
        return func(*args, **kwargs)


# Lightning Fabric's name for the same mode
_EmptyInit = EmptyInit


def _has_meta_device_parameters_or_buffers(obj: torch.nn.Module | torch.optim.Optimizer, recurse: bool = True) -> bool:
    """Whether a module has a parameter or buffer on the meta device (an optimizer: a parameter it steps)."""
    if isinstance(obj, torch.optim.Optimizer):
        return any(p.is_meta for group in obj.param_groups for p in group["params"] if isinstance(p, torch.nn.Parameter))
    if isinstance(obj, torch.nn.Module):
        return any(t.is_meta for t in chain(obj.parameters(recurse=recurse), obj.buffers(recurse=recurse)))
    raise TypeError(f"expected a torch.nn.Module or a torch.optim.Optimizer, got {type(obj).__name__}")


def _materialize(module: torch.nn.Module, device: torch.device | str | int) -> None:
    """Give ``module``'s own tensors (not its children's) uninitialized memory on ``device``, then ``reset_parameters()``."""
    if not hasattr(module, "reset_parameters"):
        raise TypeError(
            f"{type(module).__name__} has tensors on the meta device but no reset_parameters() method, which"
            " materializing needs to initialize them"
        )
    module.to_empty(device=device, recurse=False)
    if callable(module.reset_parameters):
        module.reset_parameters()


def _materialize_meta_tensors(module: torch.nn.Module, device: torch.device | str | int) -> None:
    """Materialize every submodule of ``module`` (itself included) that holds a tensor on the meta device.

    Submodules whose tensors are real already are left alone, so a model whose checkpoint covered only part of it
    keeps the loaded values. A submodule with meta tensors needs ``reset_parameters()`` (TypeError otherwise).
    """
    for submodule in module.modules():
        if _has_meta_device_parameters_or_buffers(submodule, recurse=False):
            _materialize(submodule, device)


__all__ = ["EmptyInit"]
