"""The objects of checkpoints on a store (any fsspec URL): the commit record, generations, checked transfers. A store
has no rename and no fsync, so a save becomes the checkpoint by a *commit record* written last (its generation, each
object's size and CRC-32, and each item's of a sharded data file: a load fetches just the ranges its ranks read and
still checks every byte). The previous checkpoint stays loadable until the record is written; older generations go
only after it. fsspec and the storage libraries are imported on first use of a URL, never at ``import fabric``.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric._core.processes import process_alive
from fabric._core.urls import redact, store_errors, unreachable
from fabric.checkpoint.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CommitRecordError,
    ConcurrentSaveError,
    CorruptCheckpointError,
)
from fabric.checkpoint.integrity import crc32

RECORD_FORMAT = "fabric-commit"
RECORD_VERSION = 1
DATA_SUFFIX = ".fabric"  # the generations of the checkpoint at URL live under URL.fabric/
FILE_OBJECT = "checkpoint.pt"  # the one object of a single-file checkpoint
RECORD_COPY = ".fabric-record"  # in a generation: a copy of its commit record, written before the commit
ITEMS_KEY = "items_crc32"  # in a sharded record's entry of a data file: each item's CRC-32, in file order
_CHUNK = 8 << 20
_RANGE_PIECE = 32 << 20  # a fetched byte range is read in GETs of at most this many bytes
_MAX_GAP = 1 << 20  # items of one object closer than this are fetched in one GET (the gap is read and dropped)


def reading(url: str, what: str = "the checkpoint") -> AbstractContextManager[None]:
    """A read of ``what`` at ``url``: the library's errors as ours (``urls.store_errors``); a checkpoint's own
    (CheckpointLoadError) and a missing object's (FileNotFoundError, which the callers make theirs) pass."""
    return store_errors(f"read {what}", url, passing=(CheckpointLoadError, FileNotFoundError))


# ---- the commit record ----------------------------------------------------------------------


@dataclass
class Record:
    kind: str  # "file" | "sharded"
    generation: str
    # name (relative to the generation) -> {"size", "crc32"} and, for a sharded checkpoint's data file,
    # ITEMS_KEY: the CRC-32 of each item the index places in it, in the order of their offsets
    objects: dict[str, dict[str, Any]]


def generation_prefix(path: str, generation: str) -> str:
    return f"{path}{DATA_SUFFIX}/{generation}"


def new_generation() -> str:
    """A name no other save of the same target picks: the time (so generations sort) and a random part."""
    return f"{time.time_ns():x}-{secrets.token_hex(4)}"


def write_record(fs: Any, path: str, record: Record) -> None:
    """Make the generation of ``record`` the checkpoint at ``path``: one small object, written last."""
    fs.pipe_file(path, _record_bytes(record))


def _record_bytes(record: Record) -> bytes:
    body = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "kind": record.kind, "generation": record.generation,
            "objects": record.objects}
    return json.dumps(body, sort_keys=True).encode()


def read_record(fs: Any, path: str, url: str) -> Record:
    """The commit record at ``path``; FileNotFoundError if there is nothing, CommitRecordError if it is no record."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        hint = ""
        if _generations(fs, path):
            hint = " (objects of a save exist, but no commit record: that save did not finish)"
        raise CheckpointNotFoundError(f"Checkpoint not found: {redact(url)!r}{hint}") from None
    except IsADirectoryError:
        raise CommitRecordError(f"{redact(url)!r} is a folder on the store, not a checkpoint with a commit record") from None
    return _parse_record(data, url)


def _parse_record(data: bytes, url: str) -> Record:
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
            raise ValueError
        if body.get("version") != RECORD_VERSION:
            raise CommitRecordError(f"{redact(url)!r}: commit record version {body.get('version')!r} is not one this fabric reads")
        objects: dict[str, dict[str, Any]] = {}
        for name, item in body["objects"].items():
            entry: dict[str, Any] = {"size": int(item["size"]), "crc32": int(item["crc32"])}
            if ITEMS_KEY in item:
                entry[ITEMS_KEY] = [int(crc) for crc in item[ITEMS_KEY]]
            objects[str(name)] = entry
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


def commit(fs: Any, path: str, url: str, record: Record) -> None:
    """Make ``record``'s generation, whole on the store, the checkpoint at ``path``; then remove what no record can
    name any more. Safe beside another writer of the same path (two jobs, or a job and its restarted copy):

    - every generation keeps a copy of its record (``RECORD_COPY``, written before the commit), so the record of
      any whole generation can be written again;
    - a clean-up removes only generations *older* than its own save's, never the one the record names when it
      looks, and looks again after removing: had the other writer just committed one of the removed generations,
      it writes its own record back (its own generation is whole: no writer removes a newer one than its own);
    - after writing its record, a writer checks that its objects are still there: had the other writer's clean-up
      removed them first, it makes the newest whole generation the checkpoint again and raises
      (``ConcurrentSaveError``).

    Either way the record names one whole save."""
    fs.pipe_file(f"{generation_prefix(path, record.generation)}/{RECORD_COPY}", _record_bytes(record))
    write_record(fs, path, record)
    if not _whole(fs, path, record):
        _recommit_newest_whole(fs, path, url)
        raise ConcurrentSaveError(
            f"Could not save the checkpoint {redact(url)!r}: another save of the same URL, running at the same time,"
            " removed this save's objects before it was committed; the checkpoint there is the other save's, whole"
        )
    _remove_older_generations(fs, path, url, record)


def _recommit_newest_whole(fs: Any, path: str, url: str) -> None:
    """Write again the record of the newest generation that is whole (from its record's copy); never raises."""
    folder = f"{path}{DATA_SUFFIX}"
    try:
        fs.invalidate_cache(folder)
        generations = {entry[len(folder) + 1 :].split("/", 1)[0] for entry in fs.find(folder) if entry.startswith(f"{folder}/")}
        for generation in sorted(generations, key=lambda name: _age(name) or 0, reverse=True):
            try:
                copy = _parse_record(fs.cat_file(f"{generation_prefix(path, generation)}/{RECORD_COPY}"), url)
            except Exception:
                continue  # a save in progress, or cut: no copy of a record
            if copy.generation == generation and _whole(fs, path, copy):
                write_record(fs, path, copy)
                return
    except Exception:
        pass


def _record_or_none(fs: Any, path: str, url: str) -> Record | None:
    try:
        return read_record(fs, path, url)
    except Exception:  # none yet, no record, or unreadable: nothing to compare with
        return None


def _whole(fs: Any, path: str, record: Record) -> bool:
    """Whether every object ``record`` lists is on the store with the size it lists (one listing)."""
    prefix = generation_prefix(path, record.generation)
    try:
        fs.invalidate_cache(prefix)
        sizes = {name.rstrip("/")[len(prefix) + 1 :]: info.get("size") for name, info in fs.find(prefix, detail=True).items()}
    except (FileNotFoundError, NotADirectoryError):
        return False
    return all(sizes.get(name) == entry["size"] for name, entry in record.objects.items())


def _age(generation: str) -> int | None:
    """The time a generation's save started (its name's first part, ns in hex); None for a name of another form."""
    try:
        return int(generation.split("-", 1)[0], 16)
    except ValueError:
        return None


def _remove_older_generations(fs: Any, path: str, url: str, own: Record) -> None:
    """After the commit of ``own``: remove the generations older than it that the record does not name (one listing, a
    read of the record, one bulk delete per 1000 objects, a second read); never raises. A generation newer than
    ``own`` is another writer's (in progress, or committed since): its own clean-up, or the next save's, removes it."""
    folder = f"{path}{DATA_SUFFIX}"
    own_age = _age(own.generation)
    try:
        fs.invalidate_cache(folder)
        entries = [entry.rstrip("/") for entry in fs.find(folder, withdirs=True)]
        named = _record_or_none(fs, path, url)
        keep = {own.generation, named.generation if named is not None else own.generation}
        doomed_generations = set()
        doomed = []
        for entry in entries:
            if not entry.startswith(f"{folder}/"):
                continue
            generation = entry[len(folder) + 1 :].split("/", 1)[0]
            age = _age(generation)
            if generation not in keep and (age is None or own_age is None or age < own_age):
                doomed.append(entry)
                doomed_generations.add(generation)
        if not doomed:
            return
        fs.rm(sorted(doomed))  # files and their folders (a store without folders takes a folder's name as a missing key)
        after = _record_or_none(fs, path, url)
        if after is not None and after.generation in doomed_generations:
            write_record(fs, path, own)  # the other writer committed what was just removed: ours is whole
    except Exception:  # the new checkpoint is committed; leftovers are removed by the next save
        pass


class _Digesting:
    """A write-only file that passes everything to ``file`` and keeps its size and CRC-32, and the first error a write
    to ``file`` raised (``error``: torch.save reports it only as "unexpected pos")."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.size = 0
        self.crc = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._file.write(view)
        except BaseException as err:
            if self.error is None:
                self.error = err
            raise
        self.size += len(view)
        self.crc = crc32(view, self.crc)
        return len(view)

    def flush(self) -> None:
        pass


class ItemDigests:
    """The CRC-32 of each of ``spans`` (``(offset, length)``, sorted, not overlapping) of a byte stream that arrives in
    pieces, in order (:meth:`update` with each piece and where it starts); bytes outside them are not digested."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        self.spans = list(spans)
        self.crcs = [0] * len(self.spans)
        self._next = 0  # the first span not yet wholly seen

    def update(self, data: Any, position: int) -> None:
        view = memoryview(data).cast("B")
        end = position + len(view)
        index = self._next
        while index < len(self.spans):
            offset, length = self.spans[index]
            if offset >= end:
                break
            start, stop = max(offset, position), min(offset + length, end)
            if start < stop:
                self.crcs[index] = crc32(view[start - position : stop - position], self.crcs[index])
            if offset + length <= end:
                self._next = index + 1
            index += 1


def item_crcs_of_file(local: Path, spans: Sequence[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each of ``spans`` (``(offset, length)``) of the local file ``local``, in offset order."""
    digests = ItemDigests(sorted(spans))
    with open(local, "rb", buffering=0) as file:
        position = 0
        while chunk := file.read(_CHUNK):
            digests.update(chunk, position)
            position += len(chunk)
    return digests.crcs


def write_object(fs: Any, path: str, produce: Callable[[Any], None], where: str) -> dict[str, Any]:
    """Write ``produce(file)`` into the object ``path``; its size and CRC-32. A failed write is given up (``_give_up``)
    and raises the store's own error where the store failed (not torch's "unexpected pos" for it)."""
    file = fs.open(path, "wb")
    digesting = _Digesting(file)
    try:
        produce(digesting)
        file.close()
    except BaseException as err:
        failed = digesting.error if digesting.error is not None else err
        answers = not unreachable(failed)
        _give_up(file, answers)
        if answers:
            remove_object_quietly(fs, path)
        if failed is not err:
            raise failed from failed.__cause__  # its own cause, if any, without torch's error about it
        raise
    return {"size": digesting.size, "crc32": digesting.crc}


def _give_up(file: Any, store_answers: bool) -> None:
    """A file open for writing whose object will not be made: where the store answers, the library throws away what it
    sent (s3fs aborts its multipart upload); then the file is marked closed without a flush, so that collecting it
    sends nothing (fsspec closes a collected file, uploading what it buffered: after a store stopped answering, that
    upload waited on the store as the process ended, and kept it from ending)."""
    if store_answers:
        discard = getattr(file, "discard", None)
        try:
            if callable(discard):
                discard()
        except Exception:
            pass
    try:
        file.closed = True
    except Exception:  # a file whose `closed` cannot be set is closed by other means or holds nothing to send
        pass


def upload_file(fs: Any, local: Path, path: str, where: str) -> dict[str, Any]:
    """Copy the local file ``local`` to the object ``path``: its size and CRC-32, taken from the bytes sent."""

    def produce(file: Any) -> None:
        with open(local, "rb", buffering=0) as source:
            while chunk := source.read(_CHUNK):
                file.write(chunk)

    return write_object(fs, path, produce, where)


class GrowingUpload:
    """The upload of a local file while it is being written: a thread sends to the object ``path`` what the writer
    has written so far (:meth:`grew`), read back from the file and digested on its way (:meth:`abort` discards it).
    Writing and uploading overlap, so a staged save costs about what the slower of the two costs, not their sum."""

    def __init__(self, fs: Any, local: Path, path: str, where: str) -> None:
        import threading

        self._fs, self._local, self._path, self._where = fs, local, path, where
        self._changed = threading.Condition()
        self._written = 0
        self._sent = 0  # read by grew() without the lock: only a hint of when to wake the thread
        self._closed = False
        self._aborted = False
        self._digest: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fabric-upload", daemon=True)
        self._thread.start()

    def grew(self, written: int) -> None:
        with self._changed:
            self._written = written
            if written - self._sent >= _CHUNK:
                self._changed.notify()

    def finish(self, written: int) -> dict[str, Any]:
        with self._changed:
            self._written, self._closed = written, True
            self._changed.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._digest is not None
        return self._digest

    def abort(self) -> None:
        with self._changed:
            self._aborted = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._digest = write_object(self._fs, self._path, self._send, self._where)
        except BaseException as err:
            self._error = err

    def _send(self, file: Any) -> None:
        with open(self._local, "rb", buffering=0) as source:
            position = 0
            while True:
                with self._changed:
                    while not (self._aborted or self._closed or self._written - position >= _CHUNK):
                        self._changed.wait()
                    if self._aborted:
                        raise _Aborted(redact(self._where))
                    end, last = self._written, self._closed
                while position < end:
                    chunk = os.pread(source.fileno(), min(_CHUNK, end - position), position)
                    if not chunk:
                        raise OSError(f"{str(self._local)!r} ended at byte {position} while {end} were written")
                    file.write(chunk)
                    position += len(chunk)
                    self._sent = position
                if last:
                    return


class _Aborted(Exception):
    """The upload of a growing file was given up (the write failed)."""


def new_staging(purpose: str) -> Path:
    """A new private local folder (in ``TMPDIR``) for a rank's part of a sharded checkpoint to or from a store; the caller
    removes it. A rank killed mid-save cannot remove its own (as large as its part of the model): the name says which
    process on which host made it, and each process's first one removes those of this host whose process is gone."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{purpose}-{os.getpid()}-{_host_tag()}-"))
    if folder.parent not in _swept_staging:
        _swept_staging.add(folder.parent)
        remove_abandoned_staging(folder.parent)
    return folder


STAGING_PREFIX = "fabric-staging-"
_swept_staging: set[Path] = set()


def _host_tag() -> str:
    """This host, as 8 hex digits (a staging folder's name is no place for a long host name)."""
    import socket

    return f"{crc32(socket.gethostname().encode()):08x}"


def remove_abandoned_staging(folder: Path) -> list[Path]:
    """Remove the staging folders in ``folder`` made on this host by processes no longer alive; never raises."""
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        parts = entry.name[len(STAGING_PREFIX) :].split("-") if entry.name.startswith(STAGING_PREFIX) else []
        if len(parts) < 4 or not parts[1].isdigit() or parts[2] != _host_tag() or process_alive(int(parts[1])):
            continue  # not a staging folder of this host's (or one of an older version), or its process runs
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def remove_object_quietly(fs: Any, path: str, **options: Any) -> None:
    """``fs.rm(path, **options)`` if it can be done; never raises."""
    try:
        fs.rm(path, **options)
    except Exception:
        pass


def remove_failed_generation(fs: Any, path: str, url: str, generation: str) -> None:
    """After a failed save: remove its generation's objects, unless the record names it (its commit may have landed
    before the error); best effort, never raises. Other generations are left: another writer's may be in progress."""
    named = _record_or_none(fs, path, url)
    if named is None or named.generation != generation:
        remove_object_quietly(fs, generation_prefix(path, generation), recursive=True)


def fetch_object(fs: Any, path: str, record: Record, name: str, url: str, local: Path | None = None) -> int:
    """The object ``name`` of ``record``, its size and CRC-32 checked against the record (CorruptCheckpointError naming
    what differs), read into the new local file ``local``, else an anonymous in-memory file: its descriptor, for the caller to close."""
    fd = _anonymous_file() if local is None else os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        remote, where, size = _listed_object(fs, path, record, name, url)
        digests = ItemDigests([(0, size)])
        _fetch_range(fs, remote, 0, size, digests, fd, local, where, "(truncated while it was read)")
        if digests.crcs[0] != record.objects[name]["crc32"]:
            raise CorruptCheckpointError(f"{where}: its bytes do not match the CRC-32 in the commit record (damaged, or from another save)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _where(url: str, record: Record, name: str) -> str:
    return f"{redact(url)!r} (object {name!r} of generation {record.generation})"


def _expected(record: Record, name: str, url: str) -> dict[str, Any]:
    expected = record.objects.get(name)
    if expected is None:
        raise CorruptCheckpointError(f"{_where(url, record, name)}: the commit record does not list it")
    return expected


def _listed_object(fs: Any, path: str, record: Record, name: str, url: str) -> tuple[str, str, int]:
    """(path on the store, how messages name it, size) of the object ``name``, there with the size the record lists."""
    expected = _expected(record, name, url)
    where = _where(url, record, name)
    remote = f"{generation_prefix(path, record.generation)}/{name}"
    # asked of the store, not of the listing cache: a process that listed or loaded this generation before would
    # otherwise take a deleted or truncated object for whole, and its GET would fail with the library's raw error
    fs.invalidate_cache(remote)
    try:
        size = fs.size(remote)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing: the commit record lists it ({expected['size']} bytes)") from None
    if size != expected["size"]:
        raise CorruptCheckpointError(f"{where} has {size} bytes, the commit record says {expected['size']} (truncated, or from another save)")
    return remote, where, size


def _fetch_range(fs: Any, remote: str, start: int, end: int, digests: ItemDigests, fd: int, local: Path | None, where: str, cut: str) -> None:
    """Bytes ``start`` to ``end`` of ``remote``, digested and written to ``fd`` (at their offsets in ``local``, else
    in order), in GETs of up to 32 MiB: each one call to the store, so each bounded (``cat_file``). An object deleted
    since its size was asked is named as missing, as one deleted before."""
    position = start
    while position < end:
        stop = min(end, position + _RANGE_PIECE)
        try:
            piece = fs.cat_file(remote, start=position, end=stop)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where} is missing: the commit record lists it") from None
        if not piece:
            raise CorruptCheckpointError(f"{where} ends at byte {position}, before byte {end} {cut}")
        if len(piece) > stop - position:  # a store that answers a range with more bytes: none of them is trusted
            raise CommitRecordError(f"{where}: the store answered bytes {position} to {stop} with {len(piece)} bytes")
        digests.update(piece, position)
        _write_all(fd, piece, position if local is not None else None, where, local)
        position += len(piece)


def _write_all(fd: int, data: Any, offset: int | None, where: str, local: Path | None) -> None:
    """Write ``data`` to ``fd`` (at ``offset``, else at its position); a full local disk is named as such."""
    view = memoryview(data).cast("B")
    try:
        while view:
            written = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
            view = view[written:]
            if offset is not None:
                offset += written
    except OSError as err:
        if local is None or not err.strerror:
            raise
        raise OSError(
            err.errno,
            f"Cannot fetch {where} into the local staging file {str(local)!r}: {err.strerror}"
            + (" (set TMPDIR to a folder with room for this rank's part of the checkpoint)" if err.errno == errno.ENOSPC else ""),
        ) from None


Item = tuple[int, int, str]  # (offset, length, what it holds: named in errors)


def fetch_items(
    fs: Any, path: str, record: Record, name: str, url: str, local: Path, items: Sequence[Item], crcs: dict[tuple[int, int], int]
) -> None:
    """Copy the byte ranges ``items`` of the data file ``name`` into the same offsets of the local file ``local`` (the
    rest of it stays a hole), each checked against its CRC-32 in ``crcs`` (:func:`item_crcs`); a missing object, one
    of another size, or an item whose bytes differ raises CorruptCheckpointError naming the object (and the item)."""
    remote, where, _ = _listed_object(fs, path, record, name, url)
    fd = os.open(local, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        unique = {(offset, length): held for offset, length, held in items}
        for group in _runs(sorted((offset, length, held) for (offset, length), held in unique.items())):
            start, end = group[0][0], group[-1][0] + group[-1][1]
            digests = ItemDigests([(offset, length) for offset, length, _ in group])
            _fetch_range(fs, remote, start, end, digests, fd, local, where, "the index places data up to (truncated)")
            for (offset, length, held), crc in zip(group, digests.crcs):
                if crc != crcs[(offset, length)]:
                    raise CorruptCheckpointError(
                        f"{where}: the bytes of {held!r} (bytes {offset} to {offset + length}) do not match the CRC-32 in the"
                        " commit record (damaged, or from another save)"
                    )
    finally:
        os.close(fd)


def item_crcs(record: Record, name: str, spans: Sequence[tuple[int, int]], url: str) -> dict[tuple[int, int], int]:
    """The CRC-32 the commit record keeps (in offset order) for each of ``spans``, all the items the index places in the
    data file ``name``, by ``(offset, length)``; a record that keeps another number of them raises CorruptCheckpointError."""
    expected = _expected(record, name, url)
    crcs = expected.get(ITEMS_KEY)
    every = sorted(set(spans))
    if not isinstance(crcs, list) or len(crcs) != len(every):
        raise CorruptCheckpointError(
            f"{_where(url, record, name)}: the commit record keeps {len(crcs) if isinstance(crcs, list) else 'no'} item"
            f" checksums for it, the index places {len(every)} items there (the record and the index are not of one save)"
        )
    return dict(zip(every, crcs))


def _runs(items: list[Item]) -> list[list[Item]]:
    """``items`` (sorted, not overlapping) grouped into runs read by one GET: the next item starts less than
    _MAX_GAP after the last one ends."""
    runs: list[list[Item]] = []
    for item in items:
        if runs and 0 <= item[0] - (runs[-1][-1][0] + runs[-1][-1][1]) < _MAX_GAP:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("fabric-checkpoint", getattr(os, "MFD_CLOEXEC", 0))
    import tempfile

    with tempfile.TemporaryFile() as file:  # the duplicate descriptor keeps the (already unlinked) file open
        return os.dup(file.fileno())
