"""What the checkpoint wing needs of a CheckpointIO plugin. The plugins (``fabric.plugins.io``: Lightning's
``CheckpointIO`` interface and fabric's ``TorchCheckpointIO``) implement it from above; nothing here knows them.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard

import torch

__all__ = ["CheckpointPlugin", "StorePlugin", "takes_store"]


class CheckpointPlugin(Protocol):
    """How a single-file checkpoint becomes bytes and back: the three calls of Lightning's ``CheckpointIO`` that the
    wing makes (on rank 0 for a save, on every rank for a load), and what the plugin can take."""

    @property
    def takes_store(self) -> bool:
        """True: the plugin writes and reads fabric's single-file format through the ``Store`` the wing located, so it
        is given that store (a URL resolved once, a load's detection adopted) and a load's GPU (``device=``); a sharded
        format, which writes with DCP, loses nothing by not calling it; a folder at its path is no checkpoint of its.
        False (a user's plugin): it gets the path the user gave, as Lightning Fabric's plugins do."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None: ...

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any: ...


class StorePlugin(CheckpointPlugin, Protocol):
    """A plugin that takes stores: its load also reads straight onto a GPU."""

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None, *, device: torch.device | None = None
    ) -> Any: ...


def takes_store(plugin: CheckpointPlugin) -> TypeGuard[StorePlugin]:
    """Whether ``plugin`` is given the wing's ``Store`` (and a GPU to load onto) rather than the user's path."""
    return bool(plugin.takes_store)
