"""Sharded checkpoints on a store (any fsspec URL) through a local staging folder, made visible by the commit record
(the flow: "A sharded checkpoint on a store" in docs/architecture.md). A save's staging folder is not synced: it need
not survive a crash; a failure anywhere leaves the previous checkpoint (its record is untouched). Every rank of a load
uses the one record rank 0 read: a save committing meanwhile cannot give two ranks two checkpoints.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem

import fabric.checkpoint.storage.objects as storage
from fabric._core.urls import error_summary, filesystem, redact, unreachable
from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError
from fabric.checkpoint.storage.disk import RecordingWriter
from fabric.checkpoint.storage.store import ShardedRead, ShardedSave

__all__ = ["StoreFolder", "StoreSave"]


class _Tee:
    """The stream torch's writer writes a data file to: the staging file, each byte also handed to its upload (which reads it back)."""

    def __init__(self, fd: int, upload: storage.GrowingUpload | None) -> None:
        self._fd = fd
        self._upload = upload
        self.position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            view = view[os.write(self._fd, view) :]
        self.position += size
        if self._upload is not None:
            self._upload.grew(self.position)
        return size

    def tell(self) -> int:
        return self.position

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass  # the file is closed by the file system that opened it


class _UploadingFileSystem(FileSystem):
    """torch's local file system, except that each data file (``*.distcp``) is uploaded while it is written (``start``:
    None, no store to upload to). ``uploads``: each data file's digest, or the error its upload met."""

    def __init__(self, start: Callable[[Path], storage.GrowingUpload] | None) -> None:
        super().__init__()
        self._start = start
        self.uploads: dict[str, dict[str, Any] | BaseException] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        upload = None
        try:
            if self._start is not None:
                try:
                    upload = self._start(path)
                except Exception as err:  # reported with the rank's other upload errors, after the write
                    self.uploads[path.name] = err
            tee = _Tee(fd, upload)
            try:
                yield tee
            except BaseException:
                if upload is not None:
                    upload.abort()
                raise
            if upload is not None:
                try:
                    self.uploads[path.name] = upload.finish(tee.position)
                except Exception as err:
                    self.uploads[path.name] = err
        finally:
            os.close(fd)


# A rank's part is written as up to this many data files, by as many of torch's writer threads, each uploaded
# while it is written: one object store upload is one stream of sequential part uploads, so several in flight
# (measured: 4 files per rank, 0.52x the time of 1 on the local S3 server) are what makes a save fast; a part
# under _BYTES_PER_FILE per file is one file. (A local folder keeps one file per rank: its spare is reused.)
_MAX_FILES = 4
_BYTES_PER_FILE = 16 << 20


class StoreSave(ShardedSave):
    """One rank's side of a sharded save to a store: its shards written into a staging folder and uploaded as they
    are written (the rest of its folder, rank 0's index, once written); rank 0 uploads the format's file last and
    commits the record."""

    room_hint = " (set TMPDIR to a folder with room)"

    def __init__(self, url: str, generation: str) -> None:
        self.url, self.generation = url, generation
        self.folder = storage.new_staging("save")
        self._unreachable: Exception | None = None
        self._files: _UploadingFileSystem | None = None
        self._silent = False  # the store could not be reached from this rank: no clean-up call (it would only wait)

    def writer(self, nbytes: int) -> Any:
        start: Callable[[Path], storage.GrowingUpload] | None = None
        try:
            fs, path = filesystem(self.url)
            prefix = storage.generation_prefix(path, self.generation)
            start = lambda local: storage.GrowingUpload(fs, local, f"{prefix}/{local.name}", self.url)  # noqa: E731
        except Exception as err:  # this rank still writes its part (the save is a collective), then reports it
            self._unreachable = err
        self._files = _UploadingFileSystem(start)
        files = max(1, min(_MAX_FILES, nbytes // _BYTES_PER_FILE))
        return RecordingWriter(self.folder, sync_files=False, thread_count=files, fs=self._files)

    def part(self, writer: Any, rank: int) -> dict[str, Any]:
        """Each data file's upload digest with its items' CRC-32s, and every other file of the folder (rank 0's index)
        uploaded now, or the error this rank met."""
        try:
            if self._unreachable is not None:
                raise self._unreachable
            assert self._files is not None
            uploads = self._files.uploads
            fs, path = filesystem(self.url)
            prefix = storage.generation_prefix(path, self.generation)
            items: dict[str, list[tuple[int, int]]] = {}
            for info in writer.written:
                items.setdefault(info.relative_path, []).append((info.offset, info.length))
            for name in sorted(set(uploads) - set(items)):  # a file torch opened but put no item in: not part of the save
                storage.remove_object_quietly(fs, f"{prefix}/{name}")
            uploaded: dict[str, Any] = {}
            for name, spans in sorted(items.items()):
                digest = uploads.get(name)
                if isinstance(digest, BaseException):
                    raise digest
                if digest is None:  # (torch wrote it other than through create_stream: upload it now)
                    digest = storage.upload_file(fs, self.folder / name, f"{prefix}/{name}", self.url)
                if digest["size"] != (self.folder / name).stat().st_size:
                    raise OSError(f"the upload of {name!r} sent {digest['size']} bytes of {(self.folder / name).stat().st_size}")
                uploaded[name] = {**digest, storage.ITEMS_KEY: storage.item_crcs_of_file(self.folder / name, spans)}
            for local in sorted(self.folder.iterdir()):  # written whole once the shards were (rank 0's index)
                if local.name not in uploads and local.name not in items and local.is_file():
                    uploaded[local.name] = storage.upload_file(fs, local, f"{prefix}/{local.name}", self.url)
            return {"uploaded": uploaded}
        except Exception as err:
            self._silent = unreachable(err)
            failed = f"uploading rank {rank}'s part failed: {type(err).__name__}: {error_summary(err, self.url)}"
            raises = "TimeoutError" if isinstance(err, TimeoutError) else "OSError" if self._silent else "RuntimeError"
            return {"error": failed, "raises": raises}

    def commit(self, parts: list[dict[str, Any]], name: str, write: Callable[[IO[bytes]], None]) -> None:
        fs, path = filesystem(self.url)
        prefix = storage.generation_prefix(path, self.generation)
        uploaded = {uploaded: digest for part in parts for uploaded, digest in part["uploaded"].items()}
        try:
            uploaded[name] = storage.write_object(fs, f"{prefix}/{name}", write, self.url)
            storage.commit(fs, path, self.url, storage.Record("sharded", self.generation, uploaded))
        except BaseException as err:
            self._silent = unreachable(err)  # (a commit record sent may still land: its generation must stay whole)
            raise

    def describe(self, err: BaseException) -> str:
        return error_summary(err, self.url)

    def abort(self) -> None:
        """Every rank is done uploading: this save's generation goes, unless the record names it, or this rank could not
        reach the store (the next save removes it)."""
        if self._silent:
            return
        try:
            fs, path = filesystem(self.url)
        except Exception:
            return
        storage.remove_failed_generation(fs, path, self.url, self.generation)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- loading ---------------------------------------------------------------------------------------

# a load's staging folder, as messages of the local checks name it (on any rank: its own folder's name)
_LOAD_STAGING = re.compile(r"[^'\"\s]*" + re.escape(storage.STAGING_PREFIX) + r"load-[A-Za-z0-9_-]+")


class StoreFolder(ShardedRead):
    """A committed sharded checkpoint on a store, fetched as needed into a local staging folder (removed by
    :meth:`close`). ``record()``: the commit record (the one every rank adopted from rank 0's detection)."""

    def __init__(self, url: str, record: Callable[[], storage.Record]) -> None:
        self.url = url
        self.shown = redact(url)
        self._record = record
        self.folder = storage.new_staging("load")
        self._crcs: dict[str, dict[tuple[int, int], int]] = {}  # data file -> (offset, length) of each item -> CRC-32
        self._fetched: dict[str, set[tuple[int, int]]] = {}

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _store(self) -> tuple[Any, str, storage.Record]:
        fs, path = filesystem(self.url)
        return fs, path, self._record()

    def open(self, names: Collection[str]) -> Path:
        """The staging folder with the objects ``names``, each fetched whole and checked against the commit record."""
        fs, path, record = self._store()
        with storage.reading(self.url, "the sharded checkpoint"):
            for name in names:
                if not (self.folder / name).exists():
                    os.close(storage.fetch_object(fs, path, record, name, self.url, self.folder / name))
        return self.folder

    def recorded(self) -> tuple[str, dict[str, int]]:
        _, _, record = self._store()
        return record.generation, {name: entry["size"] for name, entry in record.objects.items()}

    def expect_items(self, spans: dict[str, list[tuple[int, int]]]) -> None:
        _, _, record = self._store()
        self._crcs = {name: storage.item_crcs(record, name, items, self.url) for name, items in spans.items()}

    def fetch(self, needed: dict[str, list[tuple[int, int, str]]]) -> set[str]:
        """Bring the items ``needed`` into the staging folder, each checked against its CRC-32 in the commit record; up to
        four files at once (a store serves parallel GETs faster than one stream), raising the first file's error in name
        order. Returns the files now there whole (for the checks a local folder's files get)."""
        from concurrent.futures import ThreadPoolExecutor

        fs, path, record = self._store()
        work = []
        for name, items in sorted(needed.items()):
            crcs = self._crcs.get(name)
            if crcs is None:
                raise CorruptCheckpointError(f"Checkpoint {self.shown!r}: its index places items in {name!r}, which the commit record does not list")
            have = self._fetched.setdefault(name, set())
            missing = [item for item in items if (item[0], item[1]) not in have]
            unknown = [item for item in missing if (item[0], item[1]) not in crcs]
            if unknown:
                raise CorruptCheckpointError(f"Checkpoint {self.shown!r}: {unknown[0][2]!r} is not an item the index places in {name!r}")
            if missing:
                work.append((name, missing, crcs))

        def fetch(name: str, missing: list[tuple[int, int, str]], crcs: dict[tuple[int, int], int]) -> None:
            storage.fetch_items(fs, path, record, name, self.url, self.folder / name, missing, crcs)

        with storage.reading(self.url, "the sharded checkpoint"):
            if len(work) > 1:
                with ThreadPoolExecutor(max_workers=min(_MAX_FILES, len(work)), thread_name_prefix="fabric-fetch") as pool:
                    futures = [pool.submit(fetch, *job) for job in work]
                    errors = [future.exception() for future in futures]
                for error in errors:
                    if error is not None:
                        raise error
            elif work:
                fetch(*work[0])
        whole = set()
        for name, missing, crcs in work:
            have = self._fetched[name]
            have.update((offset, length) for offset, length, _ in missing)
            if len(have) == len(crcs):
                whole.add(name)
        return whole

    @contextmanager
    def naming(self) -> Iterator[None]:
        try:
            yield
        except CheckpointLoadError as err:  # every load error derives from it (fabric.checkpoint.errors)
            if err.args and isinstance(err.args[0], str):
                err.args = (_LOAD_STAGING.sub(self.shown, err.args[0]), *err.args[1:])
            raise
