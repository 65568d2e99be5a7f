"""Turning the ``state`` dict of ``Fabric.save``/``Fabric.load`` into a checkpoint and back.

The walk over the entries lives here, once; what a module or an optimizer becomes is asked of the
strategy (``get_module_state_dict``, ``load_optimizer_state_dict``, ...), so a sharded strategy changes
only those hooks. Loading checks every entry first and changes objects only when all of them fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.stateful import checks_state, is_stateful
from fabric.utilities.exceptions import CheckpointMismatchError

__all__ = [
    "StateDictHooks",
    "check_entries_present",
    "check_filter",
    "check_optimizer_state_fits",
    "check_state_dict_fits",
    "check_stateful_entry",
    "collect_states",
    "filtered",
    "restore_states",
]

StateFilter = dict[str, Callable[[str, Any], bool]]


class StateDictHooks(Protocol):
    """What a module or an optimizer becomes in a checkpoint, and how it comes back: the strategy's answer
    (DDP drops its wrapper's prefix; a sharded strategy hands full tensors to sharded parameters)."""

    def get_module_state_dict(self, module: Module) -> dict[str, Any]: ...

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None: ...

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]: ...

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None: ...


def collect_states(strategy: StateDictHooks, state: dict[str, Any], filter: StateFilter | None = None) -> dict[str, Any]:
    """``state`` with every module, optimizer and Stateful object replaced by its state dict.

    ``filter`` maps a key to a ``(name, value) -> bool`` predicate choosing the entries of that state dict to keep.
    """
    converted: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, Module):
            value = strategy.get_module_state_dict(obj)
        elif isinstance(obj, Optimizer):
            value = strategy.get_optimizer_state(obj)
        elif is_stateful(obj):
            value = obj.state_dict()
        else:
            value = obj
        converted[key] = filtered(key, value, filter)
    return converted


def filtered(key: str, value: Any, filter: StateFilter | None) -> Any:
    """``value`` (a state dict) with only the entries ``filter[key]`` keeps, as ``Fabric.save(filter=...)`` asks."""
    if filter is None or key not in filter:
        return value
    if not isinstance(value, dict):
        raise TypeError(f"filter[{key!r}] applies to dicts, but state[{key!r}] is a {type(value).__name__}")
    keep = filter[key]
    return {name: item for name, item in value.items() if keep(name, item)}


def check_entries_present(path: str | os.PathLike, state: dict[str, Any], saved: Any, strict: bool) -> None:
    """KeyError if ``strict`` and some key of ``state`` has no entry among ``saved``'s keys."""
    missing = [key for key in state if key not in saved]
    if missing and strict:
        raise KeyError(
            f"Checkpoint {str(path)!r} has no entry for {missing} (it holds {sorted(saved)});"
            " pass strict=False to load the entries it has"
        )


def check_stateful_entry(key: str, obj: Any, saved: Any) -> None:
    """Ask a ``CheckedStateful`` entry whether ``saved`` fits it (ValueError naming ``state[key]`` if not)."""
    if not checks_state(obj):
        return
    try:
        obj.check_state_dict(saved)
    except ValueError as err:
        raise ValueError(f"state[{key!r}]: {err}") from None


def check_filter(filter: Any, state: dict[str, Any]) -> None:
    """Raise unless ``filter`` maps keys of ``state`` to ``(name, value) -> bool`` predicates."""
    if not isinstance(filter, dict):
        raise TypeError(f"save(filter=...) takes a dict of state key -> callable, got {type(filter).__name__}")
    for key, predicate in filter.items():
        if key not in state:
            raise ValueError(f"save(filter=...) has the key {key!r}, which is not in state (keys: {sorted(state)})")
        if not callable(predicate):
            raise TypeError(f"save(filter={{{key!r}: ...}}) must map to a callable (name, value) -> bool, got {predicate!r}")


def restore_states(
    strategy: StateDictHooks, state: dict[str, Any], checkpoint: Any, path: str | os.PathLike, strict: bool = True
) -> dict[str, Any]:
    """Load ``checkpoint``'s entries (read from ``path``) into the objects of ``state``; return the rest.

    Plain values of ``state`` are replaced by the saved ones. Every entry is checked before any is
    loaded, so a mismatch leaves every object as it was.
    """
    if not isinstance(checkpoint, dict):
        raise TypeError(f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not a dict of states")
    check_entries_present(path, state, checkpoint, strict)
    present = {key: obj for key, obj in state.items() if key in checkpoint}
    for key, obj in present.items():
        _check_entry(key, obj, checkpoint[key], strict)
    remainder = dict(checkpoint)
    for key, obj in present.items():
        value = remainder.pop(key)
        if isinstance(obj, Module):
            strategy.load_module_state_dict(obj, value, strict=strict)
        elif isinstance(obj, Optimizer):
            strategy.load_optimizer_state_dict(obj, value)
        elif is_stateful(obj):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return remainder


def _check_entry(key: str, obj: Any, saved: Any, strict: bool) -> None:
    """Raise (naming ``state[key]``) if ``saved`` cannot be loaded into ``obj``."""
    if not isinstance(obj, (Module, Optimizer)):
        check_stateful_entry(key, obj, saved)
        return
    try:
        if isinstance(obj, Module):
            check_state_dict_fits(obj, saved, strict=strict)
        else:
            check_optimizer_state_fits(obj, saved)
    except (KeyError, RuntimeError, ValueError, TypeError) as err:
        message = err.args[0] if err.args else str(err)
        raise type(err)(f"state[{key!r}]: {message}") from None


def check_state_dict_fits(module: Module, state_dict: Any, strict: bool = True) -> None:
    """Raise before loading if ``state_dict`` would not load into ``module`` whole.

    ``Module.load_state_dict`` copies the matching tensors before it reports a shape mismatch, leaving
    the module half-loaded; checking first keeps it intact.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"Expected a state dict (a dict of tensors) for {type(module).__name__}, got {type(state_dict).__name__}")
    expected = module.state_dict()
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"The checkpoint does not fit {type(module).__name__}: missing keys {missing},"
                f" unexpected keys {unexpected}. Pass strict=False to load the keys that match."
            )
    for key, value in state_dict.items():
        target = expected.get(key)
        if isinstance(target, Tensor) and isinstance(value, Tensor) and target.shape != value.shape:
            raise RuntimeError(
                f"The checkpoint does not fit {type(module).__name__}: first mismatching key {key!r} has shape"
                f" {tuple(value.shape)} in the checkpoint but {tuple(target.shape)} in the model"
            )


def check_optimizer_state_fits(optimizer: Optimizer, state_dict: Any) -> None:
    """Raise ValueError if ``state_dict`` is not an optimizer state with the same parameter group sizes."""
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
        raise ValueError(f"Expected an optimizer state dict for {type(optimizer).__name__}, got {type(state_dict).__name__}")
    saved = [len(group["params"]) for group in state_dict["param_groups"]]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved != current:
        raise ValueError(
            f"The optimizer state does not fit {type(optimizer).__name__}: parameter group sizes {saved} in the"
            f" checkpoint, {current} in the optimizer"
        )
