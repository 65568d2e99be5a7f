"""Catching bit rot: every tensor torch writes carries a CRC-32, and we check it before anything is loaded.

``torch.save`` writes a zip archive whose records (the pickle and one record per storage) each carry the
CRC-32 of their bytes in the archive's directory, but ``torch.load`` never checks them, so a flipped bit
in tensor data loads silently. ``torch.distributed.checkpoint`` stores every tensor of a shard file the
same way (one ``torch.save`` archive per item). This module checks those CRCs: a whole checkpoint file,
or the byte range of one item of a shard file. Nothing is added at save time, so checkpoints written
before this check existed, and by Lightning, are checked too; only the legacy (non-zip) format has
nothing to check.

The CRC runs at memory speed: ISA-L's CRC-32 (``isal``, about 20 GB/s here) where installed, else zlib's
(about 2 GB/s). benchmarks/checkpoint.py measures what it adds to a load.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import warnings
import zipfile
from collections.abc import Callable
from typing import IO, TypeVar, cast

try:  # CRC-32 (the zip polynomial) with carry-less multiplication: ~10x zlib's
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel falls back
    from zlib import crc32

__all__ = ["CorruptCheckpointError", "crc32", "load_verified", "verify_file", "verify_range"]

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature ... file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"


T = TypeVar("T")


class CorruptCheckpointError(RuntimeError):
    """Bytes of a checkpoint differ from what was written (a CRC mismatch, a truncated or unreadable record)."""


def verify_file(path: str | os.PathLike) -> bool:
    """Check every record of the ``torch.save`` archive at ``path`` against its CRC-32.

    Returns False for a file with nothing to check (the legacy pickle format); raises
    :class:`CorruptCheckpointError` naming the file and the record when the bytes differ.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0 or file.read(4) != _LOCAL_SIGNATURE:
            return False
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _verify_archive(data, 0, size, str(path))
    return True


def load_verified(path: str | os.PathLike, load: Callable[[], T]) -> T:
    """``load()`` (which reads the file at ``path``) while a second thread checks the file's CRCs.

    The check runs beside the load (the CRC releases the GIL), so it costs a few percent of the load;
    a mismatch is raised after the load returns, before anything uses what it read.
    """
    outcome: list[BaseException | bool] = []

    def check() -> None:
        try:
            outcome.append(verify_file(path))
        except BaseException as err:  # handed to the loading thread
            outcome.append(err)

    checker = threading.Thread(target=check, name="fabric-checkpoint-crc", daemon=True)
    checker.start()
    try:
        result = load()
    except BaseException:
        checker.join()
        if isinstance(outcome[0], CorruptCheckpointError):
            raise outcome[0] from None  # the precise reason the load failed
        raise
    checker.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    if outcome[0] is False:
        _say_once_nothing_to_check(path)
    return result


_told_unchecked = False


def _say_once_nothing_to_check(path: str | os.PathLike) -> None:
    global _told_unchecked
    if not _told_unchecked:
        _told_unchecked = True
        warnings.warn(
            f"{str(path)!r} is in torch's legacy (non-zip) format, which stores no checksums: its bytes cannot be"
            " checked for damage (said once per process)",
            stacklevel=3,
        )


def verify_range(path: str | os.PathLike, offset: int, length: int, what: str) -> None:
    """Check the ``torch.save`` archive stored at ``[offset, offset + length)`` of the file ``path`` (a shard
    file's item); ``what`` names the item in the error."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if offset + length > size:
            raise CorruptCheckpointError(
                f"{str(path)!r} is truncated: {what} needs bytes up to {offset + length}, the file has {size}"
            )
        if length == 0:
            return
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[offset : offset + 4] != _LOCAL_SIGNATURE:
                raise CorruptCheckpointError(f"{str(path)!r}: the data of {what} is not where the index says (damaged file)")
            _verify_archive(data, offset, length, f"{str(path)!r} ({what})")


def _verify_archive(data: mmap.mmap, start: int, length: int, where: str) -> None:
    view = memoryview(data)
    try:
        try:
            members = zipfile.ZipFile(cast(IO[bytes], _Window(data, start, length))).infolist()
        except (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError) as err:
            raise CorruptCheckpointError(f"{where} is damaged: its archive directory cannot be read ({err})") from None
        for member in members:
            begin = start + member.header_offset
            header = bytes(view[begin : begin + _LOCAL_HEADER.size])
            if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_SIGNATURE:
                raise CorruptCheckpointError(f"{where} is damaged: record {member.filename!r} has no valid header")
            fields = _LOCAL_HEADER.unpack(header)
            data_start = begin + _LOCAL_HEADER.size + fields[-2] + fields[-1]
            end = data_start + member.compress_size
            if member.compress_type != zipfile.ZIP_STORED or end > start + length:
                raise CorruptCheckpointError(f"{where} is damaged: record {member.filename!r} lies outside the archive")
            if crc32(view[data_start:end]) != member.CRC:
                raise CorruptCheckpointError(
                    f"{where} is damaged: the bytes of record {member.filename!r} ({member.compress_size} bytes) do not"
                    " match the checksum written with them (bit rot, or a partial overwrite)"
                )
    finally:
        view.release()


class _Window:
    """A read-only file over ``[start, start + length)`` of a mapping, so zipfile finds an archive stored
    inside a larger file (a shard file holds one archive per item, back to back)."""

    def __init__(self, data: mmap.mmap, start: int, length: int) -> None:
        self._data, self._start, self._length, self._pos = data, start, length, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = min(max(base + offset, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = self._length if size is None or size < 0 else min(self._pos + size, self._length)
        chunk = self._data[self._start + self._pos : self._start + end]
        self._pos = end
        return chunk

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass

