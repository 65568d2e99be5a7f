"""The CheckpointIO plugin (Lightning Fabric's interface), which implements what the checkpoint wing asks of a plugin
(``fabric.checkpoint.plugin.CheckpointPlugin``): ``TorchCheckpointIO``, the default, saves atomically and loads safely
the single-file format (``fabric.checkpoint.formats.file``) on the disk or a store; a user's plugin replaces it to
write checkpoints another way, and is handed the user's paths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from fabric.checkpoint.formats.file import safe_load, save_file
from fabric.checkpoint.storage import Store, locate


class CheckpointIO(ABC):
    """Where and how checkpoint dictionaries become files."""

    #: whether the checkpoint wing hands this plugin its ``Store`` (and a load's GPU) rather than the user's path: only
    #: a plugin that writes fabric's single-file format through the store (``CheckpointPlugin.takes_store``)
    takes_store: bool = False

    @abstractmethod
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        ...

    @abstractmethod
    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        ...

    @abstractmethod
    def remove_checkpoint(self, path: str | Path) -> None:
        ...

    def teardown(self) -> None:
        pass


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load`` on the local disk or a store, made atomic and safe. Besides a path it takes
    the ``Store`` the checkpoint pipeline located (and, for a load, looked at) already."""

    takes_store = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a subclass overrides what it saves or loads: it gets the user's paths (as from Lightning Fabric), unless it
        # says it takes stores too
        super().__init_subclass__(**kwargs)
        if "takes_store" not in vars(cls):
            cls.takes_store = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path | Store, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"TorchCheckpointIO.save_checkpoint got storage_options={storage_options!r}; it accepts none."
                " Write your own CheckpointIO plugin to use storage options."
            )
        save_file(path, checkpoint)

    def load_checkpoint(
        self,
        path: str | Path | Store,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        device: torch.device | None = None,
    ) -> dict[str, Any]:
        """``safe_load``; ``device`` (a GPU the loaded values are for): the storages saved on an accelerator are
        read into new storage there, overlapping the read, the CRC and the copy (``device_load``)."""
        return safe_load(path, map_location=map_location if map_location is not None else "cpu", weights_only=weights_only, device=device)

    def remove_checkpoint(self, path: str | Path | Store) -> None:
        locate(path, writing="remove a checkpoint").remove()
