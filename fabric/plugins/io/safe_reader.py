"""Reading a distributed checkpoint folder without running pickled code.

``torch.distributed.checkpoint`` stores its index (``.metadata``) with plain ``pickle``, and a file
planted there could run any code on load. Our reader unpickles it with an allow-list: the index's
own record classes, torch dtypes/layouts/sizes and paths, nothing callable beyond those. Non-tensor
values never go through the folder's data files (fabric keeps them in a ``weights_only`` file), so
tensors are all this reader hands out.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fabric.plugins.io.publish import INDEX_FILE as METADATA_FILE
from fabric.plugins.io.single_file import CheckpointLoadError

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} (not part of a checkpoint index)")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose index is unpickled with an allow-list (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_index(self.path, load_id=self.load_id)


def read_index(folder: Any, load_id: str | None = None) -> Metadata:
    """The ``.metadata`` index of a checkpoint folder: names, global shapes and dtypes of every tensor."""
    from pathlib import Path

    path = Path(folder) / METADATA_FILE
    try:
        with open(path, "rb") as file:
            metadata = _IndexUnpickler(file).load()
    except FileNotFoundError:
        raise CheckpointLoadError(f"{str(folder)!r} is not a sharded checkpoint: it has no {METADATA_FILE} file") from None
    except pickle.UnpicklingError as err:
        raise CheckpointLoadError(f"Checkpoint index {str(path)!r} is unsafe or corrupt: {err}") from None
    except Exception as err:  # truncated or damaged bytes derail the unpickler anywhere
        raise CheckpointLoadError(f"Checkpoint index {str(path)!r} is corrupt: {type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointLoadError(f"Checkpoint index {str(path)!r} holds a {type(metadata).__name__}, not an index")
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = load_id
    metadata.storage_meta = storage_meta
    return metadata
