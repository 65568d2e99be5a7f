"""Methods of a set-up module other than ``forward`` (``training_step``, ``generate``, ...).

A strategy's wrapper (DistributedDataParallel) does its work in its own ``forward``: a method called on
the user's module directly runs the submodules past it, and DDP then never synchronizes those
gradients. So, as in Lightning Fabric, such a call is refused with a clear error, unless the method was
marked with ``FabricModule.mark_forward_method``: a marked method runs through the wrapper's forward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import MethodType
from typing import Any

from torch.nn import Module


def check_forward_method(original: Module, method: Any) -> str:
    """The name of ``method`` (a bound method of ``original`` or its name), checked to be markable."""
    if not isinstance(method, (MethodType, str)):
        raise TypeError(f"mark_forward_method() takes a method or its name, got {type(method).__name__}")
    name = method if isinstance(method, str) else method.__name__
    if name == "forward":
        raise ValueError("mark_forward_method('forward'): forward always runs through the strategy; mark other methods")
    if not inspect.ismethod(getattr(original, name, None)):
        raise AttributeError(f"mark_forward_method({name!r}): {type(original).__name__}.{name} is not a method of the module")
    return name


def through_wrapper(call_forward: Callable[..., Any], original: Module, name: str) -> Callable[..., Any]:
    """``original.<name>`` run inside the wrapper's forward, so the wrapper's pre/post work happens around it.

    The wrapper calls ``original(...)``, whose ``forward`` is, for that one call, the marked method.
    """

    @functools.wraps(getattr(original, name))
    def run(*args: Any, **kwargs: Any) -> Any:
        previous = original.__dict__.get("forward")

        def forward_once(*inner_args: Any, **inner_kwargs: Any) -> Any:
            _restore_forward(original, previous)  # the method itself may call the real forward
            return getattr(original, name)(*inner_args, **inner_kwargs)

        original.__dict__["forward"] = forward_once
        try:
            return call_forward(*args, **kwargs)
        finally:
            _restore_forward(original, previous)

    return run


def refusing_bypass(original: Module, method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``method``, raising a RuntimeError afterwards if it ran any submodule (i.e. bypassed the wrapper)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        ran_a_module = False

        def note(*_: Any) -> None:
            nonlocal ran_a_module
            ran_a_module = True

        handles = [module.register_forward_pre_hook(note) for module in original.modules()]
        try:
            output = method(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if ran_a_module:
            raise RuntimeError(
                f"{type(original).__name__}.{name}() was called on the set-up module and ran its layers outside the"
                f" strategy's wrapper (e.g. DistributedDataParallel would not synchronize their gradients). Mark it"
                f" after setup with `model.mark_forward_method({name!r})` so that it runs through the wrapper."
            )
        return output

    return run


def _restore_forward(original: Module, previous: Any) -> None:
    if previous is None:
        original.__dict__.pop("forward", None)
    else:
        original.__dict__["forward"] = previous
