"""Catching bit rot: every tensor torch writes carries a CRC-32, and we check it before anything is loaded.

``torch.save`` writes a zip archive whose records (the pickle and one record per storage) each carry the
CRC-32 of their bytes in the archive's directory, but ``torch.load`` never checks them, so a flipped bit
in tensor data loads silently. ``torch.distributed.checkpoint`` stores every tensor of a shard file the
same way (one ``torch.save`` archive per item). This module checks those CRCs: a whole checkpoint file,
or the byte range of one item of a shard file. Nothing is added at save time, so checkpoints written
before this check existed, and by Lightning, are checked too; only the legacy (non-zip) format has
nothing to check.

The CRC runs at memory speed: ISA-L's CRC-32 (``isal``, about 20 GB/s here) where installed, else zlib's
(about 2 GB/s). benchmarks/checkpoint_load.py measures what it adds to a load.
"""

from __future__ import annotations

import os
import struct
import warnings
import zipfile
from typing import IO, cast

try:  # CRC-32 (the zip polynomial) with carry-less multiplication: ~10x zlib's
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel falls back
    from zlib import crc32

__all__ = ["CorruptCheckpointError", "check_file", "crc32", "verify_file", "verify_range"]

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature ... file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"


class CorruptCheckpointError(RuntimeError):
    """Bytes of a checkpoint differ from what was written (a CRC mismatch, a truncated or unreadable record)."""


def verify_file(path: str | os.PathLike) -> bool:
    """Check every record of the ``torch.save`` archive at ``path`` against its CRC-32.

    Returns False for a file with nothing to check (the legacy pickle format); raises
    :class:`CorruptCheckpointError` naming the file and the record when the bytes differ. The file is
    read sequentially in chunks (from a cold disk, faster than mapping it), which leaves it in the page
    cache for the load that follows.
    """
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0 or file.read(4) != _LOCAL_SIGNATURE:
            return False
        _verify_archive(file, 0, size, str(path))
    return True


def check_file(path: str | os.PathLike) -> None:
    """Check the file's CRCs before it is loaded (raising :class:`CorruptCheckpointError`); a file with
    nothing to check is said once in the log.

    The check runs in the loading thread, before the load: ISA-L's CRC holds the GIL, so a second thread
    would not overlap with ``torch.load``, and a rank's other core belongs to another rank. It costs about
    5 ms per 100 MB (benchmarks/checkpoint_load.py), and leaves the file in the page cache for the load.
    """
    if not verify_file(path):
        _say_once_nothing_to_check(path)


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
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if offset + length > size:
            raise CorruptCheckpointError(
                f"{str(path)!r} is truncated: {what} needs bytes up to {offset + length}, the file has {size}"
            )
        if length == 0:
            return
        file.seek(offset)
        if file.read(4) != _LOCAL_SIGNATURE:
            raise CorruptCheckpointError(f"{str(path)!r}: the data of {what} is not where the index says (damaged file)")
        _verify_archive(file, offset, length, f"{str(path)!r} ({what})")


_CHUNK = 8 * 2**20


def _verify_archive(file: IO[bytes], start: int, length: int, where: str) -> None:
    try:
        members = zipfile.ZipFile(cast(IO[bytes], _Window(file, start, length))).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError) as err:
        raise CorruptCheckpointError(f"{where} is damaged: its archive directory cannot be read ({err})") from None
    buffer = bytearray(min(_CHUNK, length))
    view = memoryview(buffer)
    for member in sorted(members, key=lambda member: member.header_offset):  # in file order: sequential reads
        begin = start + member.header_offset
        file.seek(begin)
        header = file.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_SIGNATURE:
            raise CorruptCheckpointError(f"{where} is damaged: record {member.filename!r} has no valid header")
        fields = _LOCAL_HEADER.unpack(header)
        data_start = begin + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        if member.compress_type != zipfile.ZIP_STORED or data_start + member.compress_size > start + length:
            raise CorruptCheckpointError(f"{where} is damaged: record {member.filename!r} lies outside the archive")
        file.seek(data_start)
        left, crc = member.compress_size, 0
        while left:
            count = file.readinto(view[: min(left, len(buffer))])  # type: ignore[attr-defined]
            if not count:
                raise CorruptCheckpointError(f"{where} is truncated inside record {member.filename!r}")
            crc = crc32(view[:count], crc)
            left -= count
        if crc != member.CRC:
            raise CorruptCheckpointError(
                f"{where} is damaged: the bytes of record {member.filename!r} ({member.compress_size} bytes) do not"
                " match the checksum written with them (bit rot, or a partial overwrite)"
            )


class _Window:
    """A read-only file over ``[start, start + length)`` of ``file``, so zipfile finds an archive stored inside
    a larger file (a shard file holds one archive per item, back to back)."""

    def __init__(self, file: IO[bytes], start: int, length: int) -> None:
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = min(max(base + offset, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = self._length if size is None or size < 0 else min(self._pos + size, self._length)
        self._file.seek(self._start + self._pos)
        chunk = self._file.read(end - self._pos)
        self._pos += len(chunk)
        return chunk

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass
