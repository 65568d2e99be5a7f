"""Reading a distributed checkpoint folder without running pickled code.

``torch.distributed.checkpoint`` stores its index (``.metadata``) with plain ``pickle``, and a file
planted there could run any code on load. Our reader unpickles it with an allow-list: the index's
own record classes, torch dtypes/layouts/sizes and paths, nothing callable beyond those. Non-tensor
values never go through the folder's data files (fabric keeps them in a ``weights_only`` file), so
tensors are all this reader hands out.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from fabric.plugins.io.integrity import crc32, verify_range
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
    """``FileSystemReader`` whose index is unpickled with an allow-list (see the module docstring), and which
    checks the CRC-32 of every item it is about to read (``integrity``), naming the file and the entry."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_index(self.path, load_id=self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        checked = set()
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            where = (info.relative_path, info.offset)
            if where in checked or info.transform_descriptors:  # a transformed (compressed) item is no archive
                continue
            checked.add(where)
            verify_range(Path(self.path) / info.relative_path, info.offset, info.length, f"entry {item.storage_index.fqn!r}")
        return super().read_data(plan, planner)


def check_index_crc(folder: Path, expected: int | None) -> None:
    """The index's bytes against the CRC-32 the objects file recorded (folders written before it was recorded: none)."""
    if expected is None:
        return
    try:
        actual = crc32((folder / METADATA_FILE).read_bytes())
    except FileNotFoundError:
        raise CheckpointLoadError(f"{str(folder)!r} is not a complete sharded checkpoint: it has no {METADATA_FILE} file") from None
    if actual != expected:
        raise CheckpointLoadError(
            f"Checkpoint {str(folder)!r} is damaged: its index {METADATA_FILE!r} does not match the checksum written with it"
        )


def check_data_files(folder: Path, metadata: Metadata) -> None:
    """Every data file the index names exists and holds the byte ranges the index gives it: checked from
    file sizes alone, before any data is read."""
    needed: dict[str, tuple[int, str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for name, (end, entry) in sorted(needed.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointLoadError(
                f"Checkpoint {str(folder)!r} is incomplete: its data file {name!r} (holding {entry!r} among others) is missing"
            ) from None
        if size < end:
            raise CheckpointLoadError(
                f"Checkpoint {str(folder)!r} is damaged: {name!r} has {size} bytes, but the index places data up to"
                f" byte {end} there (entry {entry!r}): the file was truncated"
            )


def read_index(folder: Any, load_id: str | None = None) -> Metadata:
    """The ``.metadata`` index of a checkpoint folder: names, global shapes and dtypes of every tensor."""
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
