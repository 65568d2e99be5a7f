"""Creating modules without paying for their weight initialization (``init_module(empty_init=True)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


__all__ = ["EmptyInit"]
