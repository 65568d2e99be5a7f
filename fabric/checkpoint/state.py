"""Turning the ``state`` dict of ``Fabric.save`` into a checkpoint: the save walk, once, asking the strategy (or
torch's distributed state-dict API) what a module or an optimizer becomes; loading is ``restore``'s walk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.stateful import is_stateful

__all__ = [
    "StateDictHooks",
    "StateDictSource",
    "check_filter",
    "collect_states",
    "filtered",
]

StateFilter = dict[str, Callable[[str, Any], bool]]


class StateDictSource(Protocol):
    """What a module or an optimizer becomes in a checkpoint: the strategy's answer (DDP drops its wrapper's
    prefix), or torch's distributed state-dict API for sharded formats (``layout.DistributedStateDicts``)."""

    def get_module_state_dict(self, module: Module) -> dict[str, Any]: ...

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]: ...


class StateDictHooks(StateDictSource, Protocol):
    """A :class:`StateDictSource` that also loads state dicts back (a sharded strategy hands full tensors to
    sharded parameters)."""

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None: ...

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None: ...


def collect_states(
    source: StateDictSource, state: dict[str, Any], filter: StateFilter | None = None, keys: list[str] | None = None
) -> dict[str, Any]:
    """``state`` (all entries, or ``keys``) with every module, optimizer and Stateful object replaced by its state
    dict, of which ``filter[key]``, a ``(name, value) -> bool`` predicate, chooses the entries to keep."""
    converted: dict[str, Any] = {}
    for key in state if keys is None else keys:
        obj = state[key]
        if isinstance(obj, Module):
            value = source.get_module_state_dict(obj)
        elif isinstance(obj, Optimizer):
            value = source.get_optimizer_state(obj)
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


def check_filter(filter: Any, state: dict[str, Any]) -> None:
    """Raise unless ``filter`` maps keys of ``state`` to ``(name, value) -> bool`` predicates."""
    if not isinstance(filter, dict):
        raise TypeError(f"save(filter=...) takes a dict of state key -> callable, got {type(filter).__name__}")
    for key, predicate in filter.items():
        if key not in state:
            raise ValueError(f"save(filter=...) has the key {key!r}, which is not in state (keys: {sorted(state)})")
        if not callable(predicate):
            raise TypeError(f"save(filter={{{key!r}: ...}}) must map to a callable (name, value) -> bool, got {predicate!r}")
