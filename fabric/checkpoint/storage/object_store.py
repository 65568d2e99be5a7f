"""Checkpoints on an object store (any fsspec URL); a sharded save or read goes through a local staging folder (``sharded_store``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO

from fabric._core.urls import error_summary, filesystem, redact, store_errors, unreachable
from fabric.checkpoint.errors import CommitRecordError, ConcurrentSaveError, is_pickling_error
from fabric.checkpoint.storage.objects import (
    DATA_SUFFIX,
    FILE_OBJECT,
    Record,
    commit,
    fetch_object,
    generation_prefix,
    new_generation,
    read_record,
    reading,
    remove_failed_generation,
    remove_object_quietly,
    write_object,
)
from fabric.checkpoint.storage.sharded_store import StoreFolder, StoreSave
from fabric.checkpoint.storage.store import Found, ShardedRead, ShardedSave, Store, T


class ObjectStore(Store):
    """Every object of a save under a new generation, the commit record written last (``objects``). Reads go through the
    record: the one ``detect`` read, when it ran. Nothing to clean up before a save or a load: no FIFOs, and a cut
    save's objects, which no record names, are never loaded (the next save's clean-up removes them)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.shown = redact(url)
        self._record: Record | None = None

    def __repr__(self) -> str:
        return f"ObjectStore({self.shown!r})"

    def detect(self) -> Found:
        fs, path = filesystem(self.url)
        try:
            with reading(self.url):
                record = read_record(fs, path, self.url)
        except FileNotFoundError:
            return Found("missing")
        if record.kind == "sharded":  # a save of several objects: the folder of files the record lists
            return Found("folder", frozenset(record.objects), record)
        return Found("file", record=record)

    def adopt(self, found: Found) -> None:
        self._record = found.record

    def record(self, kind: str) -> Record:
        """The commit record (the one adopted, else read now), checked to be of ``kind``."""
        if self._record is None:
            fs, path = filesystem(self.url)
            with reading(self.url):
                self._record = read_record(fs, path, self.url)
        if self._record.kind != kind:
            raise CommitRecordError(f"{self.shown!r} is a {self._record.kind} checkpoint, not a {kind} one")
        return self._record

    def exists(self) -> bool:
        fs, path = filesystem(self.url)
        with reading(self.url):
            return bool(fs.exists(path))

    def is_folder(self) -> bool:
        return False  # a store's checkpoint is its commit record, one object

    def write_file(self, produce: Callable[[IO[bytes]], None], replace_folder: bool = False) -> None:
        fs, path = filesystem(self.url)
        generation = new_generation()
        committing = False
        try:
            digest = write_object(fs, f"{generation_prefix(path, generation)}/{FILE_OBJECT}", produce, self.url)
            committing = True
            commit(fs, path, self.url, Record("file", generation, {FILE_OBJECT: digest}))
        except BaseException as err:
            # a store that could not be reached would only keep this call waiting again: the next save cleans up (and
            # a commit record sent may still land: its generation must stay whole)
            silent = unreachable(err)
            if not silent:
                remove_failed_generation(fs, path, self.url, generation)
            expected = (TypeError, ValueError, ConcurrentSaveError)  # the state's fault, or the other save's checkpoint is there
            if isinstance(err, Exception) and not isinstance(err, expected) and not is_pickling_error(err):
                kept = "the previous checkpoint, if any, is unchanged"
                if silent and committing:
                    kept = "the checkpoint there is the previous one, if any, or this one, whole: the commit record was on its way"
                raise (TimeoutError if isinstance(err, TimeoutError) else OSError)(
                    f"Could not save the checkpoint {self.shown!r}: {type(err).__name__}: {error_summary(err, self.url)} ({kept})"
                ) from err
            raise

    def read_file(self, load: Callable[[int, int, str], T]) -> T:
        record = self.record("file")
        fs, path = filesystem(self.url)
        with reading(self.url):
            fd = fetch_object(fs, path, record, FILE_OBJECT, self.url)
        try:
            return load(fd, record.objects[FILE_OBJECT]["size"], self.shown)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """The commit record first (it stops being a checkpoint), then its objects."""
        fs, path = filesystem(self.url)
        try:
            with store_errors("remove the checkpoint", self.url, passing=(FileNotFoundError,)):
                # one object: rm_file is one request, which the bound cancels (rm runs its deletes as tasks of their
                # own, which a cancelled call leaves waiting on the store)
                fs.rm_file(path)
        except FileNotFoundError:
            pass
        remove_object_quietly(fs, f"{path}{DATA_SUFFIX}", recursive=True)  # every generation

    def prepare_sharded_save(self, files_written: frozenset[str]) -> str:
        filesystem(self.url)  # the scheme and the library, checked on rank 0 before any rank writes
        return new_generation()

    def sharded_save(self, ticket: str) -> ShardedSave:
        return StoreSave(self.url, ticket)

    def sharded_read(self) -> ShardedRead:
        return StoreFolder(self.url, lambda: self.record("sharded"))

