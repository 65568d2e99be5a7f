"""The named protocol every entry of a checkpoint follows, so saving and loading need no guessing. An entry of
``state`` is a module or an optimizer, a :class:`Stateful` object (the optional declarations below refine it), or
anything else: saved as it is, and replaced by the saved value on load.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

#: The checkpoint's own top-level entry beside the user's: ``{"world_size": N, "states": {key: [the state of
#: each of the N saving ranks]}}`` for the :class:`SavedRanksStateful` entries. A checkpoint without one (written
#: by Lightning Fabric, or before this record existed) loads as before.
SAVED_RANKS_KEY = "__fabric_saved_ranks__"

__all__ = [
    "SAVED_RANKS_KEY",
    "CheckedStateful",
    "OptionalStateful",
    "PerRankStateful",
    "ResizableStateful",
    "SavedRanksStateful",
    "Stateful",
    "checks_state",
    "has_per_rank_state",
    "is_optional_entry",
    "is_resizable",
    "is_stateful",
    "keeps_saved_ranks",
]


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint holds: ``state_dict()`` out, ``load_state_dict()`` back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class CheckedStateful(Stateful, Protocol):
    """A Stateful object that can tell, without changing anything, whether a saved state fits it. Loading asks
    every entry before it changes anything, so a state that does not fit leaves every object as it was."""

    def check_state_dict(self, state_dict: Any) -> Any:
        """Raise ValueError if ``state_dict`` cannot be loaded into this object."""


class PerRankStateful(Stateful, Protocol):
    """A Stateful object whose state differs between ranks (random generator states): saving gathers every
    rank's state into the file rank 0 writes (``per_rank``), and ``load_state_dict`` receives that record of
    all ranks and picks its own."""

    per_rank_state: bool


class OptionalStateful(Stateful, Protocol):
    """A Stateful entry that a strategy adds to the user's state, which a checkpoint written without that strategy
    lacks: a strict load goes on without it (the fault-tolerant strategies' ``"ddp_ft"`` entry)."""

    optional_entry: bool


class SavedRanksStateful(Stateful, Protocol):
    """A Stateful object whose entry must stay its own ``state_dict()`` (rank 0's, the format Lightning Fabric writes),
    but which needs every rank's state on a load by another number of processes: the checkpoint keeps those beside
    the entries (:data:`SAVED_RANKS_KEY`). A set-up dataloader with a state of its own is one."""

    saved_ranks_beside: bool

    def state_from_saved_ranks(self, entry: Any, states: list[Any]) -> Any:
        """The state to load on this rank, given the saved ``entry`` and every saving rank's ``state_dict()`` in
        rank order. Called before anything is loaded (it changes nothing); raises ValueError if none fits this rank."""


@runtime_checkable
class ResizableStateful(Stateful, Protocol):
    """A user's stateful loader that can continue from a state saved by another number of processes: a per-rank
    state (its place in this rank's shard, say) needs what every saving rank had and the new job's layout.
    ``Fabric.load`` calls this only when the number of processes differs; on the same number, ``load_state_dict``
    gets the saved entry as always."""

    def resized_state_dict(self, states: list[Any], world_size: int, rank: int) -> Any:
        """This rank's state in a job of ``world_size`` processes, made from ``states`` (the ``state_dict()`` of
        each process that saved it, in rank order). Called before anything is loaded, so it must change nothing;
        raise ValueError if the job cannot continue from these states. What it returns goes to ``load_state_dict``."""


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows :class:`Stateful` (both methods callable; classes themselves do not count)."""
    return not isinstance(obj, type) and callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def checks_state(obj: Any) -> bool:
    """Whether ``obj`` declares ``check_state_dict`` (:class:`CheckedStateful`)."""
    return is_stateful(obj) and callable(getattr(obj, "check_state_dict", None))


def has_per_rank_state(obj: Any) -> bool:
    """Whether ``obj`` declares ``per_rank_state = True`` (:class:`PerRankStateful`)."""
    return is_stateful(obj) and getattr(obj, "per_rank_state", False) is True


def is_optional_entry(obj: Any) -> bool:
    """Whether ``obj`` declares ``optional_entry = True`` (:class:`OptionalStateful`)."""
    return is_stateful(obj) and getattr(obj, "optional_entry", False) is True


def keeps_saved_ranks(obj: Any) -> bool:
    """Whether ``obj`` declares ``saved_ranks_beside = True`` (:class:`SavedRanksStateful`)."""
    return is_stateful(obj) and getattr(obj, "saved_ranks_beside", False) is True and callable(getattr(obj, "state_from_saved_ranks", None))


def is_resizable(obj: Any) -> bool:
    """Whether ``obj`` declares ``resized_state_dict`` (:class:`ResizableStateful`)."""
    return is_stateful(obj) and callable(getattr(obj, "resized_state_dict", None))
