"""Turning the ``state`` dict of ``Fabric.save``/``Fabric.load`` into a checkpoint and back: the save walk, once,
asking the strategy what a module or an optimizer becomes; loading goes through ``restore``'s walk, for which
:class:`StateDictFile` reads a file of plain state dicts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.fit import check_entry
from fabric.checkpoint.restore import WholeFile
from fabric.checkpoint.stateful import is_stateful

__all__ = [
    "StateDictFile",
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


class StateDictFile(WholeFile):
    """A checkpoint of plain state dicts, read whole by a CheckpointIO, as an ``EntrySource``: the strategy's
    hooks load each module and optimizer entry (DDP into its wrapped module, Horovod into its optimizer)."""

    def __init__(self, strategy: StateDictHooks, read: Callable[[], Any], path: str | os.PathLike) -> None:
        super().__init__(path, read)
        self._strategy = strategy

    def check(self, present: dict[str, Any], strict: bool) -> None:
        checkpoint = self.keys()
        for key, obj in present.items():
            check_entry(key, obj, checkpoint[key], strict)

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None:
        self._strategy.load_module_state_dict(module, value, strict=strict)

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None:
        self._strategy.load_optimizer_state_dict(optimizer, value)
