"""Checkpoint IO: how checkpoint dictionaries become files (single-file) or folders (sharded)."""

from fabric.plugins.io.publish import atomic_save
from fabric.plugins.io.single_file import (
    CheckpointIO,
    CheckpointLoadError,
    TorchCheckpointIO,
    UnsafeCheckpointError,
    safe_load,
)

__all__ = ["CheckpointIO", "CheckpointLoadError", "TorchCheckpointIO", "UnsafeCheckpointError", "atomic_save", "safe_load"]
