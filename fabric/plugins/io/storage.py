"""Where a user's path points: the local disk, or a store reached through fsspec. One place decides.

A string with a scheme (``s3://bucket/run/ckpt.pt``, ``memory://x``, ``gs://...``) is a URL and is never
taken for a local path: it resolves to its fsspec filesystem, or stops with an error that says why (an
unknown scheme; the storage library is not installed, naming the extra that brings it). ``file://`` is
the local disk and takes the local code path. A ``Path`` or a string without a scheme is local.

An object store has no rename and no fsync, so a checkpoint becomes visible by a *commit record*: every
object of a new save is written first, under a new generation prefix beside the target
(``URL.fabric/GENERATION/...``); then one small JSON object at the target URL itself names the generation
and lists every object with its size and CRC-32. A load reads the record first and refuses a checkpoint
whose record is missing, or whose objects are missing or differ from it; the previous checkpoint stays
loadable until the new record is written, and older generations are removed only after it is.

fsspec and the storage libraries are imported on first use of a URL, never at ``import fabric``.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fabric._core.urls import MissingStorageLibraryError, filesystem, is_url, local_or_url, redact, scheme_of
from fabric.plugins.io.integrity import crc32

T = TypeVar("T")

__all__ = [
    "CommitRecordError",
    "MissingStorageLibraryError",
    "filesystem",
    "is_url",
    "local_or_url",
    "redact",
    "scheme_of",
]

RECORD_FORMAT = "fabric-commit"
RECORD_VERSION = 1
DATA_SUFFIX = ".fabric"  # the generations of the checkpoint at URL live under URL.fabric/
FILE_OBJECT = "checkpoint.pt"  # the one object of a single-file checkpoint
_CHUNK = 8 << 20


class CommitRecordError(RuntimeError):
    """A checkpoint on a store whose commit record is missing, unreadable, or does not match its objects."""


# ---- the commit record ----------------------------------------------------------------------


@dataclass
class Record:
    kind: str  # "file" | "sharded"
    generation: str
    objects: dict[str, dict[str, int]]  # name (relative to the generation) -> {"size", "crc32"}


def generation_prefix(path: str, generation: str) -> str:
    return f"{path}{DATA_SUFFIX}/{generation}"


def new_generation() -> str:
    """A name no other save of the same target picks: the time (so generations sort) and a random part."""
    return f"{time.time_ns():x}-{secrets.token_hex(4)}"


def write_record(fs: Any, path: str, record: Record) -> None:
    """Make the generation of ``record`` the checkpoint at ``path``: one small object, written last."""
    body = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "kind": record.kind, "generation": record.generation,
            "objects": record.objects}
    fs.pipe_file(path, json.dumps(body, sort_keys=True).encode())


def read_record(fs: Any, path: str, url: str) -> Record:
    """The commit record at ``path``; FileNotFoundError if there is nothing, CommitRecordError if it is no record."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        hint = ""
        if _generations(fs, path):
            hint = " (objects of a save exist, but no commit record: that save did not finish)"
        raise FileNotFoundError(f"Checkpoint not found: {redact(url)!r}{hint}") from None
    except IsADirectoryError:
        raise CommitRecordError(f"{redact(url)!r} is a folder on the store, not a checkpoint with a commit record") from None
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
            raise ValueError
        if body.get("version") != RECORD_VERSION:
            raise CommitRecordError(f"{redact(url)!r}: commit record version {body.get('version')!r} is not one this fabric reads")
        objects = {str(name): {"size": int(item["size"]), "crc32": int(item["crc32"])} for name, item in body["objects"].items()}
        return Record(str(body["kind"]), str(body["generation"]), objects)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CommitRecordError(
            f"{redact(url)!r} has no commit record: it is {len(data)} bytes of something else (a file written by another"
            " program, or damaged). A checkpoint on a store is loaded only through the commit record its save wrote last"
        ) from None


def _generations(fs: Any, path: str) -> list[str]:
    folder = f"{path}{DATA_SUFFIX}"
    try:
        fs.invalidate_cache(folder)
        return [entry.rstrip("/") for entry in fs.ls(folder, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove_other_generations(fs: Any, path: str, keep: str | None) -> None:
    """Remove every generation of ``path`` but ``keep`` (after the commit of ``keep``); never raises.

    Two requests on an object store, however many generations and objects there are: one listing of
    everything under ``URL.fabric/`` and one bulk delete (per 1000 objects) of what is not in ``keep``."""
    folder = f"{path}{DATA_SUFFIX}"
    try:
        fs.invalidate_cache(folder)
        entries = [entry.rstrip("/") for entry in fs.find(folder, withdirs=True)]
        doomed = [entry for entry in entries if entry.startswith(f"{folder}/") and entry[len(folder) + 1 :].split("/", 1)[0] != keep]
        if doomed:  # files and their folders (a store without folders takes a folder's name as a missing key)
            fs.rm(sorted(doomed))
    except Exception:  # the new checkpoint is committed; leftovers are removed by the next save
        pass


class _Digesting:
    """A write-only file that passes everything to ``file`` and keeps its size and CRC-32."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view)
        self.size += len(view)
        self.crc = crc32(view, self.crc)
        return len(view)

    def flush(self) -> None:
        pass


def write_object(fs: Any, path: str, produce: Callable[[Any], None], where: str) -> dict[str, int]:
    """Write ``produce(file)`` into the object ``path``; its size and CRC-32. A failed write is discarded."""
    file = fs.open(path, "wb")
    try:
        digesting = _Digesting(file)
        produce(digesting)
        file.close()
    except BaseException:
        discard = getattr(file, "discard", None)
        try:
            if callable(discard):
                discard()
        except Exception:
            pass
        _remove_quietly(fs, path)
        raise
    return {"size": digesting.size, "crc32": digesting.crc}


def _remove_quietly(fs: Any, path: str) -> None:
    try:
        fs.rm(path)
    except Exception:
        pass


def save_file(obj: Any, url: str) -> None:
    """``torch.save(obj)`` to the store at ``url`` under a new generation, then its commit record."""
    import torch

    fs, path = filesystem(url)
    generation = new_generation()
    try:
        digest = write_object(fs, f"{generation_prefix(path, generation)}/{FILE_OBJECT}", lambda file: torch.save(obj, file), url)
        write_record(fs, path, Record("file", generation, {FILE_OBJECT: digest}))
    except BaseException as err:
        remove_other_generations_than_committed(fs, path, url)
        if isinstance(err, Exception) and not isinstance(err, (TypeError, ValueError)):
            raise OSError(
                f"Could not save the checkpoint {redact(url)!r}: {type(err).__name__}: {_first_line(err)}"
                " (the previous checkpoint, if any, is unchanged)"
            ) from err
        raise
    remove_other_generations(fs, path, keep=generation)


def remove_other_generations_than_committed(fs: Any, path: str, url: str) -> None:
    """After a failed save: remove the objects no commit record names (best effort, never raises)."""
    try:
        committed: str | None = read_record(fs, path, url).generation
    except Exception:
        return  # cannot tell which generation is the checkpoint (the store may be gone): keep everything
    remove_other_generations(fs, path, keep=committed)


def read_committed(url: str, kind: str) -> tuple[Any, str, Record]:
    """(filesystem, path, record) of the checkpoint at ``url``, checked to be of ``kind``."""
    fs, path = filesystem(url)
    record = read_record(fs, path, url)
    if record.kind != kind:
        raise CommitRecordError(f"{redact(url)!r} is a {record.kind} checkpoint, not a {kind} one")
    return fs, path, record


def fetch_object(fs: Any, path: str, record: Record, name: str, url: str) -> int:
    """The object ``name`` of ``record`` read into an anonymous in-memory file (its descriptor), its size and
    CRC-32 checked against the record (CommitRecordError naming what differs); the caller closes it."""
    expected = record.objects.get(name)
    where = f"{redact(url)!r} (object {name!r} of generation {record.generation})"
    if expected is None:
        raise CommitRecordError(f"{where}: the commit record does not list it")
    fd = _anonymous_file()
    try:
        size, crc = 0, 0
        try:
            with fs.open(f"{generation_prefix(path, record.generation)}/{name}", "rb") as source:
                while True:
                    chunk = source.read(_CHUNK)
                    if not chunk:
                        break
                    crc = crc32(chunk, crc)
                    size += len(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
        except FileNotFoundError:
            raise CommitRecordError(f"{where} is missing: the commit record lists it ({expected['size']} bytes)") from None
        if size != expected["size"]:
            raise CommitRecordError(f"{where} has {size} bytes, the commit record says {expected['size']} (truncated, or from another save)")
        if crc != expected["crc32"]:
            raise CommitRecordError(f"{where}: its bytes do not match the CRC-32 in the commit record (damaged, or from another save)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("fabric-checkpoint", getattr(os, "MFD_CLOEXEC", 0))
    import tempfile

    with tempfile.TemporaryFile() as file:  # the duplicate descriptor keeps the (already unlinked) file open
        return os.dup(file.fileno())


def load_file(url: str, load: Callable[[int, int, str], T]) -> T:
    """``load(fd, size, name)`` over the committed single-file checkpoint at ``url``, its bytes checked first."""
    fs, path, record = read_committed(url, "file")
    fd = fetch_object(fs, path, record, FILE_OBJECT, url)
    try:
        return load(fd, record.objects[FILE_OBJECT]["size"], redact(url))
    finally:
        os.close(fd)


def remove(url: str) -> None:
    """Remove the checkpoint at ``url``: its commit record first (it stops being a checkpoint), then its objects."""
    fs, path = filesystem(url)
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    remove_other_generations(fs, path, keep=None)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return bool(fs.exists(path))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def is_sharded(url: str) -> bool:
    """Whether ``url`` holds the commit record of a sharded checkpoint."""
    fs, path = filesystem(url)
    try:
        return read_record(fs, path, url).kind == "sharded"
    except (FileNotFoundError, CommitRecordError):
        return False
