"""The callbacks and loggers given to ``Fabric``: checked where they enter, and hooks dispatched to them."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fabric.utilities.rank_zero import rank_zero_warn

# values that are certainly not callback objects: a typo such as callbacks=5 or callbacks="mine"
_NOT_A_CALLBACK = (int, float, complex, str, bytes)


def callbacks_from_argument(callbacks: Any) -> list[Any]:
    """``Fabric(callbacks=...)`` as a list: one object or a list/tuple of objects whose methods are hooks."""
    found = _as_list(callbacks)
    for callback in found:
        if callback is None or isinstance(callback, _NOT_A_CALLBACK):
            raise TypeError(
                f"Fabric(callbacks=...) got {callback!r} ({type(callback).__name__}); accepted: an object with hook"
                " methods (e.g. on_train_epoch_end), or a list of them"
            )
    return found


def loggers_from_argument(loggers: Any) -> list[Any]:
    """``Fabric(loggers=...)`` as a list: one logger or a list/tuple of them (objects with ``log_metrics``)."""
    found = _as_list(loggers)
    for logger in found:
        if not callable(getattr(logger, "log_metrics", None)) or isinstance(logger, type):
            raise TypeError(
                f"Fabric(loggers=...) got {logger!r} ({type(logger).__name__}); accepted: a logger such as"
                " fabric.loggers.CSVLogger or TensorBoardLogger (anything with log_metrics), or a list of them"
            )
    return found


def call_hook(callbacks: list[Any], hook_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Call ``hook_name`` on each callback that has it, with only the keyword arguments its method accepts."""
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            rank_zero_warn(f"Skipping the callback attribute {type(callback).__name__}.{hook_name}: it is not callable")
            continue
        method(*args, **_accepted_kwargs(method, kwargs))


def _accepted_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    if not kwargs:
        return kwargs
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: it gets everything
        return kwargs
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return kwargs
    names = {parameter.name for parameter in parameters if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return {name: value for name, value in kwargs.items() if name in names}


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]
