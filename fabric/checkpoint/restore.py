"""Loading a checkpoint into the objects of ``state``: the one walk of every format (``docs/architecture.md``).

Check, read into new storage, then apply: the first two change nothing the user holds, and the ranks agree after
each (``agree``), so if one rank failed every rank raises and a damaged or mismatched checkpoint never leaves
replicas that differ. The record of the saving processes (``SAVED_RANKS_KEY``) is read in the check: a
``SavedRanksStateful`` entry says from it which state it loads on this rank, or why none fits, before anything changes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection
from typing import Any, Protocol, TypeVar

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.fit import check_entries_present, check_plain_value, check_saved_ranks, checked
from fabric.checkpoint.layout import kind_saved_in
from fabric.checkpoint.stateful import SAVED_RANKS_KEY, is_stateful

__all__ = ["Agreement", "EntrySource", "WholeFile", "restore"]

T = TypeVar("T")


class Agreement(Protocol):
    """Runs ``step`` on every rank and raises on every rank if it failed on any (``agreement.on_every_rank``)."""

    def __call__(self, step: Callable[[], T], what: str) -> T: ...


class EntrySource(Protocol):
    """One checkpoint, as the walk reads it: what it holds, its checks, its reads, and how values go in."""

    @property
    def path(self) -> str | os.PathLike: ...

    def keys(self) -> Collection[str]:
        """The checkpoint's top-level keys (reads the index, or the file)."""

    def check(self, present: dict[str, Any], strict: bool) -> None:
        """Raise ``CheckpointMismatchError`` if an entry does not fit its object in ``present``; reads no tensor data."""

    def saved_value(self, key: str) -> Any:
        """The saved entry ``key``, neither a module nor an optimizer, as written (whole; no tensor data read)."""

    def saved_kind(self, key: str) -> str:
        """What the entry ``key`` was saved from (``layout.MODULE``, ``OPTIMIZER`` or ``OTHER``), as the
        checkpoint records it or its value shows; reads no tensor data beyond what ``keys`` read."""

    def read(self, present: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the values for ``present``'s keys, in new storage; the rest of the checkpoint): changes no object."""

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None: ...

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None: ...


class WholeFile:
    """The part of an :class:`EntrySource` for a checkpoint read whole into memory by ``read_file`` (a single
    file): its keys, and its values (already in new storage, their CRCs checked when it was read)."""

    def __init__(self, path: str | os.PathLike, read_file: Callable[[], Any]) -> None:
        self.path = path
        self._read_file = read_file
        self._checkpoint: dict[str, Any] | None = None

    def keys(self) -> dict[str, Any]:
        if self._checkpoint is None:
            checkpoint = self._read_file()
            if not isinstance(checkpoint, dict):
                raise CheckpointMismatchError(f"Checkpoint {str(self.path)!r} holds a {type(checkpoint).__name__}, not a dict of states")
            self._checkpoint = checkpoint
        return self._checkpoint

    def saved_value(self, key: str) -> Any:
        return self.keys()[key]

    def saved_kind(self, key: str) -> str:
        return kind_saved_in(self.keys()[key])  # a file records no kinds: its value shows them

    def read(self, present: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Nothing more to read: the values of ``present``'s keys, and the rest."""
        rest = dict(self.keys())
        return {key: rest.pop(key) for key in present}, rest


def restore(source: EntrySource, state: dict[str, Any], *, strict: bool, agree: Agreement) -> dict[str, Any]:
    """Load ``source`` into the objects of ``state`` (plain values are replaced); return what else it held."""

    def check() -> tuple[dict[str, Any], dict[str, Any]]:
        keys = source.keys()
        saved = _entries(keys)
        check_entries_present(source.path, state, saved, strict)
        present = {key: obj for key, obj in state.items() if key in saved}
        for key, obj in present.items():
            check_plain_value(key, obj, source.saved_kind(key))
        source.check(present, strict)
        if SAVED_RANKS_KEY not in keys:
            return present, {}
        return present, check_saved_ranks(present, source.saved_value, source.saved_value(SAVED_RANKS_KEY))

    present, this_rank = agree(check, f"load the checkpoint {str(source.path)!r}")
    if state and not present:
        warnings.warn(
            f"load(strict=False) found none of the keys {sorted(state)} in {str(source.path)!r}, which holds"
            f" {sorted(_entries(source.keys()))}: nothing was loaded",
            stacklevel=4,
        )
    values, rest = agree(lambda: source.read(present), f"read the checkpoint {str(source.path)!r}")
    with checked((obj, values[key]) for key, obj in present.items() if isinstance(obj, (Module, Optimizer))):
        for key, obj in present.items():
            value = values[key]
            if isinstance(obj, Module):
                source.load_module(key, obj, value, strict)
            elif isinstance(obj, Optimizer):
                source.load_optimizer(key, obj, value)
            elif is_stateful(obj):
                obj.load_state_dict(this_rank.get(key, value))
            else:
                state[key] = value
    return rest


def _entries(keys: Collection[str]) -> list[str]:
    return [key for key in keys if key != SAVED_RANKS_KEY]
