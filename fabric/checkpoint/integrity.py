"""Catching bit rot: every tensor torch writes carries a CRC-32, and we check it on the bytes that are loaded.

The directory of a ``torch.save`` archive (a whole file, or one item of a shard file) holds the CRC-32 of
every record, but ``torch.load`` never checks them, so a flipped bit loads silently. Nothing is added at
save time, so older checkpoints and Lightning's are checked too (torch's legacy format has no CRCs). The
check costs one look at bytes in the CPU cache anyway: :class:`CheckedArchive` takes each chunk's CRC right
after reading it into the storage ``torch.load`` loads into, and a damaged record raises before ``torch.load``
returns, so a caller that loads into new storage changes nothing. The CRC is ISA-L's (``isal``, about 50 GB/s
on data in the cache here) where installed, else zlib's (about 4 GB/s).
"""

from __future__ import annotations

import bisect
import contextlib
import io
import os
import struct
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

try:  # CRC-32 (the zip polynomial) with carry-less multiplication: ~10x zlib's
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel falls back
    from zlib import crc32 as crc32

from fabric.checkpoint.errors import CorruptCheckpointError

T = TypeVar("T")

# the zip structures torch's writer uses (all little-endian)
_LOCAL = struct.Struct("<4s5H3L2H")  # signature ... file name length, extra field length: 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # signature, versions, flags, method, time, date, crc, sizes, lengths ...: 46
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_END = struct.Struct("<4s4H2LH")  # end of central directory: 22 bytes (+ comment)
_END_SIGNATURE = b"PK\x05\x06"
_END64_LOCATOR = struct.Struct("<4sLQL")  # where the zip64 end record is: 20 bytes, just before the end record
_END64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory: 56 bytes
_END64_SIGNATURE = b"PK\x06\x06"
_TAIL = 4096  # read at the archive's end to find its directory (torch's reader reads as much)
_MAX_COMMENT = 0xFFFF
SMALL_ARCHIVE = 64 * 2**10  # an archive up to this size is read whole, checked, then loaded from memory
_NOTHING = memoryview(b"")
CRC_CHUNK = 512 * 2**10  # read, then CRC, this much at a time: the chunk is still in the core's L2 cache
_DIGESTED = struct.Struct("<QL")  # a record's size and CRC-32, as records_digest folds them in


class _Record:
    """One record of an archive: where its local header is, its size and CRC; its data start once known."""

    __slots__ = ("crc", "data", "header", "name", "size", "verified")

    def __init__(self, name: str, header: int, size: int, crc: int) -> None:
        self.name, self.header, self.size, self.crc = name, header, size, crc
        self.data = -1  # offset of the record's bytes in the archive, read from its local header
        self.verified = False


class CheckedArchive:
    """The ``torch.save`` archive at ``[start, start + length)`` of the open file ``fd`` as the binary file
    ``torch.load`` reads, each record's CRC-32 checked as its bytes pass; ``where`` names it in errors. Its
    directory is read (a damaged one refused) when it is made; :meth:`finish` checks what was not on the way."""

    def __init__(self, fd: int, start: int, length: int, where: str) -> None:
        self._fd, self._start, self._length, self._where = fd, start, length, where
        self._pos = 0
        self._records, self._directory_start, self._tail = _read_directory(_file_reader(fd, start), length, where)
        self._headers = [record.header for record in self._records]
        self._by_header = {record.header: record for record in self._records}
        self._by_data: dict[int, _Record] = {}
        self._current: _Record | None = None  # the record whose bytes are passing, its next offset and CRC so far
        self._next, self._crc = -1, 0
        self._checked = False  # whether any record has been checked yet
        self.error: CorruptCheckpointError | None = None
        self._head = os.pread(fd, min(_TAIL, length), start)
        self._tail_start = length - len(self._tail)
        self._head_end = self._cache_records(self._head, 0)  # reads inside [0, head_end) are served from memory,
        self._tail_from = self._cache_records(self._tail, self._tail_start, from_end=True)  # and inside [tail_start, length)

    def _cache_records(self, cache: bytes, at: int, from_end: bool = False) -> int:
        """Check the records ``cache`` (the archive's bytes from ``at``) holds whole: those before the first
        large one, or (``from_end``) every one after it. Returns where the part served from ``cache`` ends (or
        starts): torch's many small reads there cost no system call and hand out only bytes checked here."""
        end = at + len(cache)
        records = [record for record in self._records if record.header >= at] if from_end else self._records
        for record in records:
            if record.header + _LOCAL.size > end:
                return record.header
            self._learn_header(record, cache[record.header - at : record.header - at + _LOCAL.size])
            if record.data + record.size > end:  # (never at the end: the directory follows every record)
                return record.header
            self._verify(record, crc32(memoryview(cache)[record.data - at : record.data - at + record.size]))
        if from_end:
            return records[0].header if records else self._directory_start
        return end

    def readable(self) -> bool:  # the file interface, as any version of torch.load may ask it
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1:
            offset += self._pos
        elif whence == 2:
            offset += self._length
        self._pos = min(max(offset, 0), self._length)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        position = self._pos
        end = self._length if size is None or size < 0 else min(position + size, self._length)
        if end <= self._head_end:
            data = self._head[position:end]
        elif position >= self._tail_start:
            data = self._from_tail(position, end)
        else:
            data = os.pread(self._fd, max(end - position, 0), self._start + position)
            if data:
                self._passed(position, memoryview(data))
        self._pos = position + len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        """Read into ``buffer`` (the storage being loaded) a chunk at a time, each chunk's CRC taken at once."""
        view = memoryview(buffer).cast("B")
        position = self._pos
        wanted = min(len(view), self._length - position)
        if wanted <= 0:
            return 0
        if position + wanted <= self._head_end:
            view[:wanted] = self._head[position : position + wanted]
        elif position >= self._tail_start:
            view[:wanted] = self._from_tail(position, position + wanted)
        else:
            done = 0
            while done < wanted:
                chunk = view[done : done + CRC_CHUNK] if wanted - done > CRC_CHUNK or done or wanted < len(view) else view
                count = os.preadv(self._fd, [chunk], self._start + position + done)
                if count <= 0:
                    break
                self._passed(position + done, chunk if count == len(chunk) else chunk[:count])
                done += count
            wanted = done
        self._pos = position + wanted
        return wanted

    def _from_tail(self, position: int, end: int) -> bytes:
        if position < self._tail_from:  # the end of a large record, handed out unchecked: check it again later
            self._distrust(position, min(end, self._tail_from))
        return self._tail[position - self._tail_start : end - self._tail_start]

    def names(self) -> list[str]:
        return [record.name for record in self._records]

    def record_size(self, name: str) -> int:
        return self._record(name).size

    def read_record(self, name: str) -> bytes:
        record = self._located(self._record(name))
        self.seek(record.data)
        data = self.read(record.size)
        if len(data) < record.size:
            raise self._fail(f"{self._where} is truncated inside record {name!r}")
        return data

    def read_record_into(self, name: str, buffer: Any) -> None:
        """Read record ``name`` whole into ``buffer`` (exactly its size), checked as it passes."""
        self._read_whole(self._located(self._record(name)), buffer)

    def _read_whole(self, record: _Record, buffer: Any) -> None:
        self.seek(record.data)
        if self.readinto(buffer) < record.size:
            raise self._fail(f"{self._where} is truncated inside record {record.name!r}")

    def _record(self, name: str) -> _Record:
        for record in self._records:
            if record.name == name:
                return record
        raise KeyError(name)

    def _located(self, record: _Record) -> _Record:
        """``record``, with where its bytes start read from its local header if not known yet."""
        if record.data < 0:
            self._learn_header(record, os.pread(self._fd, _LOCAL.size, self._start + record.header))
        return record

    def load_with(self, load: Callable[[Any], T]) -> T:
        """``load(self)`` (``torch.load`` of this archive), every record checked before it returns; a damaged
        archive raises :class:`CorruptCheckpointError`, whatever error the damage made inside ``load``."""
        self.seek(0)  # from the archive's start, whatever was read of it before
        try:
            value = load(self)
        except Exception:
            if self.error is None:
                with contextlib.suppress(CorruptCheckpointError):  # (kept as self.error)
                    self.finish()  # damage elsewhere explains the failure better than the loader's own error
            if self.error is not None:
                raise self.error from None
            raise
        self.finish()
        return value

    def finish(self) -> None:
        """Check every record not checked as it passed (read again from the file); raise on the first damage."""
        if self.error is not None:
            raise self.error
        buffer: bytearray | None = None
        for record in self._records:
            if record.verified or self._located(record).verified:  # (an empty record is verified once located)
                continue
            if buffer is None:
                buffer = bytearray(min(CRC_CHUNK, max(record.size for record in self._records)))
            view = memoryview(buffer)
            left, crc, offset = record.size, 0, self._start + record.data
            while left:
                count = os.preadv(self._fd, [view[: min(left, len(buffer))]], offset)
                if count <= 0:
                    raise self._fail(f"{self._where} is truncated inside record {record.name!r}")
                crc = crc32(view[:count], crc)
                left, offset = left - count, offset + count
            self._verify(record, crc)

    def _passed(self, position: int, data: memoryview) -> None:
        """Account for ``data``, read at ``position``: a record's bytes read from its start, in order, are checked."""
        while data:
            record = self._by_data.get(position)
            if record is not None:  # a record's bytes from their start: check them as they come
                record.verified = False
                self._current, self._crc = record, 0
            elif self._current is not None and position == self._next:
                record = self._current
            else:
                data, position = self._other_read(position, data)
                continue
            left = record.data + record.size - position
            if len(data) < left:
                self._crc = crc32(data, self._crc)
                self._next = position + len(data)
                return
            self._crc = crc32(data[:left] if len(data) > left else data, self._crc)
            self._current = None
            self._verify(record, self._crc)
            position, data = position + left, data[left:]

    def _other_read(self, position: int, data: memoryview) -> tuple[memoryview, int]:
        """A read other than a record's bytes in order (a local header, the directory, part of a record read out of
        order: checked again by ``finish``). Returns what of ``data`` is left: a record's bytes, if they follow."""
        self._current = None
        end = position + len(data)
        self._distrust(position, end)
        starting = self._by_header.get(position)
        if starting is None or len(data) < _LOCAL.size:
            return _NOTHING, end
        if starting.data < 0:
            self._learn_header(starting, bytes(data[: _LOCAL.size]))
        if starting.verified or starting.data >= end:
            return _NOTHING, end
        return data[starting.data - position :], starting.data

    def _distrust(self, position: int, end: int) -> None:
        """Bytes ``[position, end)`` were read out of order: a checked record they touch is checked again by ``finish``."""
        if not self._checked:
            return
        records = self._records
        for index in range(max(bisect.bisect_right(self._headers, position) - 1, 0), len(records)):
            record = records[index]
            if record.header >= end:
                break
            if record.verified and record.data < end and position < record.data + record.size:
                record.verified = False

    def _learn_header(self, record: _Record, header: bytes) -> None:
        try:
            _data_start(record, header, self._directory_start, self._where)
        except CorruptCheckpointError as err:
            raise self._fail(str(err)) from None
        if record.size == 0:
            self._verify(record, 0)
        else:
            self._by_data[record.data] = record

    def _verify(self, record: _Record, crc: int) -> None:
        if crc != record.crc:
            raise self._fail(mismatch_message(record.name, record.size, self._where))
        record.verified = self._checked = True

    def _fail(self, message: str) -> CorruptCheckpointError:
        """The error to raise (kept, so that it wins over whatever error torch makes of it)."""
        if self.error is None:
            self.error = CorruptCheckpointError(message)
        return self.error


def load_checked(load: Callable[[Any], T], fd: int, start: int, length: int, where: str) -> T:
    """``load(file)`` (``torch.load``) of the archive at ``[start, start + length)`` of ``fd``, as
    :meth:`CheckedArchive.load_with`. One of up to 64 KiB (an optimizer step, a bias) is read whole and checked
    in memory instead: cheaper than the many small reads ``torch.load`` makes of a file."""
    if length <= SMALL_ARCHIVE:
        image = os.pread(fd, length, start)
        if len(image) < length:
            raise CorruptCheckpointError(f"{where} is truncated: it needs {length} bytes, the file has {len(image)} there")
        _check_image(image, where)
        return load(io.BytesIO(image))
    return CheckedArchive(fd, start, length, where).load_with(load)


def _check_image(image: bytes, where: str) -> None:
    """Check every record of the archive held whole in ``image``."""
    records, directory_start, _ = _read_directory(lambda offset, count: image[offset : offset + count], len(image), where)
    view = memoryview(image)
    for record in records:
        _data_start(record, image[record.header : record.header + _LOCAL.size], directory_start, where)
        if crc32(view[record.data : record.data + record.size]) != record.crc:
            raise CorruptCheckpointError(mismatch_message(record.name, record.size, where))


def _data_start(record: _Record, header: bytes, directory_start: int, where: str) -> None:
    """Set where ``record``'s bytes start, from its local ``header``."""
    if len(header) < _LOCAL.size or header[:4] != _LOCAL_SIGNATURE:
        raise CorruptCheckpointError(f"{where} is damaged: record {record.name!r} has no valid header")
    fields = _LOCAL.unpack(header)
    record.data = record.header + _LOCAL.size + fields[-2] + fields[-1]
    if record.data + record.size > directory_start:
        raise CorruptCheckpointError(f"{where} is damaged: record {record.name!r} lies outside the archive")


def mismatch_message(name: str, size: int, where: str) -> str:
    """What a record whose bytes differ from their CRC is refused with."""
    return (
        f"{where} is damaged: the bytes of record {name!r} ({size} bytes) do not match the checksum"
        " written with them (bit rot, or a partial overwrite)"
    )


def records_digest(fd: int, archives: list[tuple[int, int]], where: str) -> int:
    """A CRC-32 over the size and CRC-32 of every record of the archives ``archives`` (``(start, length)``, in
    order) of ``fd``, read from their directories alone (no pass over the data): it changes when any record's
    bytes do, so it binds a data file to the save that recorded it."""
    digest = 0
    for start, length in archives:
        records, _, _ = _read_directory(_file_reader(fd, start), length, where)
        digest = crc32(b"".join(_DIGESTED.pack(record.size, record.crc) for record in records), digest)
    return digest


_said: set[str] = set()  # the keys warn_once has warned about in this process


def warn_once(key: str, message: str) -> None:
    """Warn with ``message`` the first time ``key`` comes up in this process (at the caller's caller)."""
    if key not in _said:
        _said.add(key)
        warnings.warn(message, stacklevel=3)


def _file_reader(fd: int, start: int) -> Callable[[int, int], bytes]:
    return lambda offset, count: os.pread(fd, count, start + offset)


def _read_directory(read_at: Callable[[int, int], bytes], length: int, where: str) -> tuple[list[_Record], int, bytes]:
    """The records (in file order) of the archive of ``length`` bytes that ``read_at(offset, count)`` reads, where
    its directory starts, and its last bytes, read to find it. Only what torch writes: stored, unencrypted records."""

    def damaged(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where} is damaged: its archive directory cannot be read ({why})")

    def read(offset: int, count: int) -> bytes:
        if offset < 0 or offset + count > length:
            raise damaged("it points outside the archive")
        data = read_at(offset, count)
        if len(data) < count:
            raise damaged(f"the file ends {count - len(data)} bytes early")
        return data

    tail_start = max(length - _TAIL, 0)
    tail = read(tail_start, length - tail_start)
    at = _find_end(tail)
    if at < 0 and tail_start > 0:
        tail_start = max(length - _TAIL - _MAX_COMMENT - _END.size, 0)
        tail = read(tail_start, length - tail_start)
        at = _find_end(tail)
    if at < 0:
        raise damaged("no end-of-directory record")
    _, _, _, _, count, directory_size, offset, _ = _END.unpack_from(tail, at)
    directory_end = tail_start + at
    if directory_end >= _END64_LOCATOR.size:
        locator = read(directory_end - _END64_LOCATOR.size, _END64_LOCATOR.size)
        if locator[:4] == _END64_LOCATOR_SIGNATURE:
            end64 = _END64_LOCATOR.unpack(locator)[2]
            record = read(end64, _END64.size)
            if record[:4] != _END64_SIGNATURE:
                raise damaged("no zip64 end-of-directory record")
            count, directory_size, offset = _END64.unpack(record)[7:10]
            directory_end = end64
    if offset + directory_size != directory_end:
        raise damaged("the directory is not where its end record says")
    in_tail = offset - tail_start
    directory = tail[in_tail : in_tail + directory_size] if in_tail >= 0 else read(offset, directory_size)
    records, position = [], 0
    for _ in range(count):
        if position + _CENTRAL.size > len(directory):
            raise damaged("it lists more records than it holds")
        fields = _CENTRAL.unpack_from(directory, position)
        signature, flags, method, crc, compressed, size = fields[0], fields[3], fields[4], fields[7], fields[8], fields[9]
        name_length, extra_length, comment_length, header = fields[10], fields[11], fields[12], fields[16]
        name_end = position + _CENTRAL.size + name_length
        if signature != _CENTRAL_SIGNATURE or name_end + extra_length > len(directory):
            raise damaged("a record's entry is malformed")
        name = directory[position + _CENTRAL.size : name_end].decode("utf-8" if flags & 0x800 else "cp437", "replace")
        if 0xFFFFFFFF in (compressed, size, header):
            size, compressed, header = _zip64_sizes(directory[name_end : name_end + extra_length], size, compressed, header, damaged)
        if method != 0 or flags & 1 or compressed != size:
            raise damaged(f"record {name!r} is compressed or encrypted, which torch never writes")
        if header + _LOCAL.size + compressed > offset:
            raise CorruptCheckpointError(f"{where} is damaged: record {name!r} lies outside the archive")
        records.append(_Record(name, header, compressed, crc))
        position = name_end + extra_length + comment_length
    records.sort(key=lambda record: record.header)
    return records, offset, tail


def _find_end(tail: bytes) -> int:
    """Where the end-of-directory record (whose comment reaches the end of the archive) starts in ``tail``, or -1."""
    at = len(tail) - _END.size
    while at >= 0:
        at = tail.rfind(_END_SIGNATURE, 0, at + 4)
        if at < 0:
            return -1
        if at + _END.size + _END.unpack_from(tail, at)[-1] == len(tail):
            return at
        at -= 1
    return -1


def _zip64_sizes(extra: bytes, size: int, compressed: int, header: int, damaged: Callable[[str], Exception]) -> tuple[int, int, int]:
    """The 64-bit size, compressed size and header offset that a zip64 extra field holds in place of 0xFFFFFFFF."""
    position = 0
    while position + 4 <= len(extra):
        kind, length = struct.unpack_from("<2H", extra, position)
        if position + 4 + length > len(extra):
            break
        if kind == 1:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, position + 4))
            try:
                size = next(values) if size == 0xFFFFFFFF else size
                compressed = next(values) if compressed == 0xFFFFFFFF else compressed
                header = next(values) if header == 0xFFFFFFFF else header
            except StopIteration:
                raise damaged("a zip64 field is too short") from None
            return size, compressed, header
        position += 4 + length
    raise damaged("a 64-bit size has no zip64 field")
