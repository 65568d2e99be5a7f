"""The named protocol every object in a checkpoint follows, so saving and loading need no guessing.

An entry of the ``state`` dict given to ``Fabric.save``/``Fabric.load`` is one of:

* a module or an optimizer: the strategy turns it into a state dict and back (a sharded strategy
  overrides those hooks);
* a :class:`Stateful` object (a set-up dataloader, an LR scheduler, the user's own class): its
  ``state_dict()`` is saved and ``load_state_dict()`` restores it. Two optional declarations refine it:

  - :class:`CheckedStateful` adds ``check_state_dict(state)``, which raises ValueError when the saved
    state cannot be loaded. Loading calls it for every entry before it changes anything, so a bad
    file leaves every object as it was;
  - :class:`PerRankStateful` has ``per_rank_state`` True: its state differs between ranks (random
    generator states), so saving gathers every rank's state into the file (``per_rank.py``) and
    ``load_state_dict`` receives the record of all ranks and picks its own;
* anything else: saved as it is; loading puts the saved value into the ``state`` dict.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckedStateful", "PerRankStateful", "Stateful", "checks_state", "has_per_rank_state", "is_stateful"]


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint holds: ``state_dict()`` out, ``load_state_dict()`` back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class CheckedStateful(Stateful, Protocol):
    """A Stateful object that can tell, without changing anything, whether a saved state fits it."""

    def check_state_dict(self, state_dict: Any) -> Any:
        """Raise ValueError if ``state_dict`` cannot be loaded into this object."""
        ...


class PerRankStateful(Stateful, Protocol):
    """A Stateful object whose state differs between ranks; the checkpoint keeps every rank's state."""

    per_rank_state: bool


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows :class:`Stateful` (both methods callable; classes themselves do not count)."""
    if isinstance(obj, type):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def checks_state(obj: Any) -> bool:
    """Whether ``obj`` declares ``check_state_dict`` (:class:`CheckedStateful`)."""
    return is_stateful(obj) and callable(getattr(obj, "check_state_dict", None))


def has_per_rank_state(obj: Any) -> bool:
    """Whether ``obj`` declares ``per_rank_state = True`` (:class:`PerRankStateful`)."""
    return is_stateful(obj) and getattr(obj, "per_rank_state", False) is True
