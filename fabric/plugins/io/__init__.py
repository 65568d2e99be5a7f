"""Checkpoint IO: the CheckpointIO plugin, and the public names of the checkpoint package users import from here."""

from fabric.checkpoint.errors import CheckpointLoadError, UnsafeCheckpointError
from fabric.checkpoint.formats.file import atomic_save, safe_load
from fabric.plugins.io.checkpoint_io import CheckpointIO, TorchCheckpointIO

__all__ = ["CheckpointIO", "CheckpointLoadError", "TorchCheckpointIO", "UnsafeCheckpointError", "atomic_save", "safe_load"]
