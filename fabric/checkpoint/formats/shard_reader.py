"""Reading a distributed checkpoint folder without running pickled code.

``torch.distributed.checkpoint`` stores its index (``.metadata``) with plain ``pickle``, and a file planted
there could run any code on load: our reader unpickles it with an allow-list (the index's own record classes,
torch dtypes, layouts, sizes and paths). Non-tensor values never go through the folder's data files (fabric
keeps them in a ``weights_only`` file), so tensors are all this reader hands out (how it reads them: docs/architecture.md).
"""

from __future__ import annotations

import os
import pickle
import stat
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError
from fabric.checkpoint.formats.tensor_record import read_into
from fabric.checkpoint.integrity import SMALL_ARCHIVE, CheckedArchive, crc32, load_checked, records_digest, warn_once
from fabric.checkpoint.storage import Fetch

# the files of a sharded checkpoint folder, by name
INDEX_FILE = ".metadata"  # torch.distributed.checkpoint's index: what makes a folder a sharded checkpoint
OBJECTS_FILE = "fabric-objects.pt"  # fabric's file beside the shards: every entry but their tensors, and the index's CRC
LIGHTNING_META_FILE = "meta.pt"  # Lightning Fabric's file of non-tensor entries beside the shards (no OBJECTS_FILE)

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
        if (module in _ALLOWED_MODULES and not name.startswith("__")) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} (not part of a checkpoint index)")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` with the index's allow-list, checking the CRC-32 of every item as it reads it.
    ``staging``: tensors (plain, or DTensors' local tensors) made for this load alone, so an item that fills one
    whole may hand it its loaded storage instead of a copy. ``fetch``: called first with the items this rank's
    plan reads (``{file: [(offset, length, entry), ...]}``), to bring them into the folder (a store's checkpoint)."""

    def __init__(self, path: str | Path, staging: Iterable[Tensor] = (), fetch: Fetch | None = None) -> None:
        super().__init__(path)
        self._staging = {id(tensor): tensor for tensor in staging}
        self._fetch = fetch

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_index(self.path, load_id=self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        needed: dict[str, list[tuple[int, int, str]]] = {}
        by_file: dict[str, list[ReadItem]] = {}
        other = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if self._fetch is not None:  # (a local folder holds every item already)
                needed.setdefault(info.relative_path, []).append((info.offset, info.length, item.storage_index.fqn))
            if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:  # no tensor, or no archive (compressed)
                other.append(item)
            else:
                by_file.setdefault(info.relative_path, []).append(item)
        if self._fetch is not None:
            self._fetch(needed)
        if other:
            super().read_data(LoadPlan(other, plan.storage_data, plan.planner_data), planner).wait()
        for name, items in by_file.items():
            path = Path(self.path) / name
            with open(path, "rb", buffering=0) as file:
                for item in sorted(items, key=lambda item: self.storage_data[item.storage_index].offset):
                    self._read_item(file.fileno(), path, item, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, fd: int, path: Path, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        where = f"{str(path)!r} (entry {item.storage_index.fqn!r})"
        target = planner.resolve_tensor(item)
        staging = self._staging.get(id(target)) is target
        if staging and info.length > SMALL_ARCHIVE:
            archive = CheckedArchive(fd, info.offset, info.length, where)
            if read_into(archive, target):
                planner.commit_tensor(item, target)
                return
            loaded = archive.load_with(_load_tensor)  # another layout: the same archive, through torch.load
        else:
            loaded = load_checked(_load_tensor, fd, info.offset, info.length, where)
        if not isinstance(loaded, Tensor):
            raise CorruptCheckpointError(f"{where} holds a {type(loaded).__name__}, not a tensor")
        loaded = _narrow(loaded, item.storage_offsets, item.lengths)
        if target.shape != loaded.shape:
            raise CorruptCheckpointError(f"{where} has shape {tuple(loaded.shape)} where the index says {tuple(target.shape)}")
        if staging and _fills(target, loaded):
            target.set_(loaded)  # type: ignore[call-overload]
        else:
            target.detach().copy_(loaded)
        planner.commit_tensor(item, target)


def _load_tensor(archive: Any) -> Any:
    return torch.load(archive, map_location="cpu", weights_only=True)


def _narrow(tensor: Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """The part of a saved chunk that a read item asks for."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _fills(target: Tensor, loaded: Tensor) -> bool:
    """Whether ``loaded`` can stand in for ``target`` as it is: same dtype, device, shape and strides, and a
    storage of its own holding nothing else (so handing it over keeps no extra memory alive)."""
    return (
        loaded.dtype == target.dtype
        and loaded.device == target.device
        and loaded.stride() == target.stride()
        and loaded.storage_offset() == 0
        and loaded.untyped_storage().nbytes() == loaded.numel() * loaded.element_size()
        and not loaded.requires_grad
    )


def check_index_crc(folder: Path, expected: int | None) -> None:
    """The index's bytes against the CRC-32 the objects file recorded (folders written before it was recorded: none)."""
    if expected is None:
        return
    try:
        actual = crc32((folder / INDEX_FILE).read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{str(folder)!r} is not a complete sharded checkpoint: it has no {INDEX_FILE} file") from None
    if actual != expected:
        raise CorruptCheckpointError(
            f"Checkpoint {str(folder)!r} is damaged or mixed: its index {INDEX_FILE!r} does not match the checksum"
            f" {OBJECTS_FILE!r} recorded for it (damaged bytes, or one of the two files is from another save)"
        )


def check_data_files(folder: Path, metadata: Metadata, written: dict[str, int] | None = None, only: set[str] | None = None) -> None:
    """Every data file the index names exists and holds the byte ranges the index gives it: checked from
    file sizes alone, before any data is read. ``written``: each file's size as the save recorded it, named
    when a file is too short (it may be another save's rather than truncated). ``only``: just these files."""
    needed: dict[str, tuple[int, str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if only is not None and info.relative_path not in only:
            continue
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for name, (end, entry) in sorted(needed.items()):
        try:
            found = (folder / name).stat()
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"Checkpoint {str(folder)!r} is incomplete: its data file {name!r} (holding {entry!r} among others) is missing"
            ) from None
        except OSError as err:  # a symbolic link that loops, a name too long, ...
            raise CorruptCheckpointError(
                f"Checkpoint {str(folder)!r} is damaged: its data file {name!r} cannot be read: {err.strerror}"
            ) from None
        if not stat.S_ISREG(found.st_mode):
            raise CorruptCheckpointError(
                f"Checkpoint {str(folder)!r} is damaged: its data file {name!r} is not a regular file"
            )
        if found.st_size < end:
            raise CorruptCheckpointError(
                f"Checkpoint {str(folder)!r} is damaged: {name!r} has {found.st_size} bytes, but the index places data up to"
                f" byte {end} there (entry {entry!r}): the file was truncated"
                + (
                    f", or it does not belong to this checkpoint's save, which wrote {written[name]} bytes"
                    if written and name in written
                    else ""
                )
            )


def data_files_of(folder: Path, metadata: Metadata, only: set[str] | None = None) -> dict[str, dict[str, int]]:
    """Each data file the index names: ``{"bytes": its size, "records_crc32": its archives' records_digest}``, which
    a save records and a load compares; items stored compressed (never by fabric) are left out. ``only``: just these."""
    return data_files_written(folder, (metadata.storage_data or {}).values(), only)


def data_files_written(folder: str | Path, infos: Iterable[Any], only: set[str] | None = None) -> dict[str, dict[str, int]]:
    """:func:`data_files_of` from the storage records (``_StorageInfo``: file, offset, length) of the items a
    writer wrote, before there is an index (each rank of a save to a store digests its own files)."""
    archives: dict[str, list[tuple[int, int]]] = {}
    for info in infos:
        if only is not None and info.relative_path not in only:
            continue
        spans = archives.setdefault(info.relative_path, [])
        if not getattr(info, "transform_descriptors", None):
            spans.append((info.offset, info.length))
    found = {}
    for name, spans in sorted(archives.items()):
        path = Path(folder) / name
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            found[name] = {"bytes": size, "records_crc32": records_digest(file.fileno(), sorted(spans), repr(str(path)))}
    return found


def check_data_files_belong(
    folder: Path,
    metadata: Metadata,
    save_id: str | None,
    recorded: Any,
    share: tuple[int, int] | None = None,
    only: set[str] | None = None,
) -> None:
    """Every data file the index names exists (``check_data_files``) and is the one the save recorded in the
    objects file (same size and records' digest), else it is named; ``recorded`` is None for a folder saved
    before fabric recorded them: the index's checks alone. ``share``: ``(rank, world_size)`` when the ranks agree
    on the outcome afterwards, so each reads the digests of every ``world_size``-th file only (each directory is
    read once between them). ``only``: just these files (those a load from a store fetched whole), no other's presence."""
    if recorded is None:
        warn_once(
            "unbound folder",
            f"Checkpoint {str(folder)!r} was saved before fabric recorded which data files belong to a save: a shard"
            " file from another save cannot be detected in it (said once per process)",
        )
        check_data_files(folder, metadata)
        return
    this_save = f"the save that wrote {OBJECTS_FILE!r} and {INDEX_FILE!r} (save {save_id})"
    named = check_files_listed(str(folder), recorded, metadata, this_save, Path(folder) if only is None else None)
    written = {name: entry.get("bytes") for name, entry in recorded.items()}
    if only is not None:
        named &= only
    check_data_files(folder, metadata, written, only)  # missing, unreadable or too short for the index
    for name in sorted(named):  # sizes before digests: cheap, and the clearest reason
        size = (Path(folder) / name).stat().st_size
        if size != written[name]:
            raise CorruptCheckpointError(
                f"Checkpoint {str(folder)!r} mixes files of different saves: its data file {name!r} does not belong to"
                f" {this_save}: it has {size} bytes, that save wrote {written[name]}"
            )
    if share is not None:
        rank, world_size = share
        named = set(sorted(named)[rank::world_size])
    try:
        actual = data_files_of(folder, metadata, only=named)
    except CorruptCheckpointError as err:  # an archive's directory that cannot be read: named with the checkpoint
        raise CorruptCheckpointError(f"Checkpoint {str(folder)!r}: {err}") from None
    foreign = sorted(name for name in named if actual[name]["records_crc32"] != recorded[name].get("records_crc32"))
    if foreign:
        raise CorruptCheckpointError(
            f"Checkpoint {str(folder)!r} mixes files of different saves: its data file {foreign[0]!r}"
            + (f" (and {', '.join(map(repr, foreign[1:]))})" if len(foreign) > 1 else "")
            + f" does not belong to {this_save}: the checksums of its records differ from those that save recorded"
            " (a file from an older or another save, or another rank's file copied or swapped in)"
        )


def check_files_listed(shown: str, recorded: Any, metadata: Metadata, this_save: str, folder: Path | None = None) -> set[str]:
    """The data files the index names (returned), each listed in ``recorded`` (the objects file's list, written by
    ``this_save``); with ``folder``, the files listed beyond those are there too. Messages name ``shown``."""
    if not isinstance(recorded, dict) or not all(isinstance(entry, dict) for entry in recorded.values()):
        raise CorruptCheckpointError(f"Checkpoint {shown!r} is damaged: {OBJECTS_FILE!r} holds no valid list of data files")
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    for name in sorted(set(recorded) - named) if folder is not None else ():
        if not (folder / name).is_file():
            raise CorruptCheckpointError(f"Checkpoint {shown!r} is incomplete: its data file {name!r}, written by {this_save}, is missing")
    unlisted = sorted(named - set(recorded))
    if unlisted:
        raise CorruptCheckpointError(
            f"Checkpoint {shown!r} mixes files of different saves: {unlisted[0]!r} is named by its index but was"
            f" not written by {this_save}"
        )
    return named


def read_index(folder: Any, load_id: str | None = None) -> Metadata:
    """The ``.metadata`` index of a checkpoint folder: names, global shapes and dtypes of every tensor."""
    path = Path(folder) / INDEX_FILE
    try:
        with open(path, "rb") as file:
            metadata = _IndexUnpickler(file).load()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{str(folder)!r} is not a sharded checkpoint: it has no {INDEX_FILE} file") from None
    except pickle.UnpicklingError as err:
        raise CorruptCheckpointError(f"Checkpoint index {str(path)!r} is unsafe or corrupt: {err}") from None
    except Exception as err:  # truncated or damaged bytes derail the unpickler anywhere
        raise CorruptCheckpointError(f"Checkpoint index {str(path)!r} is corrupt: {type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"Checkpoint index {str(path)!r} holds a {type(metadata).__name__}, not an index")
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = load_id
    metadata.storage_meta = storage_meta
    return metadata


def first_failure(err: BaseException) -> str:
    """The first rank's own error inside torch's ``CheckpointException`` (which lists every rank's trace), in one line."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = own_error(err)
        text = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        return f"on rank {min(failures)}: {type(inner).__name__}: {text}"
    return f"{type(err).__name__}: {err}"


def read_error(folder: str | Path, err: BaseException) -> CheckpointLoadError:
    """A failed read of a folder's tensors, of the class of the first failed rank's own error where it is a checkpoint
    error (a CRC mismatch stays a ``CorruptCheckpointError``), naming the folder and that error."""
    refused = own_error(err)
    cls = type(refused) if isinstance(refused, CheckpointLoadError) else CheckpointLoadError
    return cls(f"Reading the checkpoint {str(folder)!r} failed: {first_failure(err)}")


def own_error(err: BaseException) -> BaseException:
    """The first rank's own error inside torch's ``CheckpointException``; ``err`` itself for any other error."""
    failures = getattr(err, "failures", None)
    if not (isinstance(failures, dict) and failures):
        return err
    inner = failures[min(failures)]
    inner = inner[0] if isinstance(inner, tuple) else inner
    return inner if isinstance(inner, BaseException) else err


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """torch warns that it "assumes" one process even when told so (``no_dist=True``): that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
