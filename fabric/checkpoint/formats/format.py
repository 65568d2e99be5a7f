"""What the formats' table (``fabric.checkpoint.formats``) needs of a format, and the one save or load it hands one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.host import CheckpointHost
from fabric.checkpoint.state import StateFilter
from fabric.checkpoint.storage import Found, Store

__all__ = ["Format", "Load", "Save", "SavingFormat"]


@dataclass(frozen=True)
class Save:
    """One save: ``state`` (per-rank states already gathered) from ``host``'s objects to ``store``; ``path`` as the
    user gave it (a user's CheckpointIO plugin gets it)."""

    host: CheckpointHost
    store: Store
    path: str | os.PathLike
    state: dict[str, Any]
    filter: StateFilter | None = None
    async_save: bool = False
    storage_options: Any = None

    def refuse_storage_options(self) -> None:
        """Only a CheckpointIO plugin takes storage options, and formats that do not write through one refuse them."""
        if self.storage_options is not None:
            raise TypeError(f"{type(self.host).__name__}.save_checkpoint got storage_options={self.storage_options!r}; it accepts none")


@dataclass(frozen=True)
class Load:
    """One load: ``state`` restored in place from ``store`` (one module or optimizer: ``load_raw``; None: the whole
    checkpoint). ``host``: the strategy whose objects these are (None: torch.distributed's default group, objects of
    any layout); ``path`` as the user gave it (a user's plugin gets it)."""

    store: Store
    state: Module | Optimizer | dict[str, Any] | None
    strict: bool = True
    weights_only: bool | None = None
    host: CheckpointHost | None = None
    path: str | os.PathLike | Store | None = None


class Format(Protocol):
    """A format of the table: whether it reads what a location holds, and the load."""

    name: str

    def claims(self, found: Found) -> bool:
        """Whether the format reads what ``found`` says is there (facts of the store, nothing read yet)."""

    def load(self, load: Load) -> Any:
        """Restore ``load.state`` in place (checked on every rank before any rank changes anything) and return the
        rest of the checkpoint; without a state, the whole checkpoint."""


class SavingFormat(Format, Protocol):
    """A format a strategy saves in (``Strategy.checkpoint_format``)."""

    def save(self, save: Save) -> None:
        """Write the state; a collective, raising on every rank if it failed anywhere."""
