"""Checkpoint IO: how checkpoint dictionaries become files (single-file) or folders (sharded)."""

from fabric.checkpoint.errors import CheckpointLoadError, UnsafeCheckpointError
from fabric.plugins.io.publish import atomic_save
from fabric.plugins.io.single_file import CheckpointIO, TorchCheckpointIO, safe_load

__all__ = ["CheckpointIO", "CheckpointLoadError", "TorchCheckpointIO", "UnsafeCheckpointError", "atomic_save", "safe_load"]
