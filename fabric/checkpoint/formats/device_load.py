"""A checked single-file load whose tensors go straight to a GPU: read, CRC and host-to-device copy overlap
(docs/architecture.md, "A single-file checkpoint's life"), where ``load_state_dict`` copied each tensor from
new pageable CPU storage, one synchronous copy after another. A damaged record raises before ``torch.load``
returns, the copies already made gone into staging that is dropped.

``torch.load`` still unpickles the file (``weights_only`` as asked): its zip reader reads a storage's record
whole, with one ``readinto`` at the record's first byte, into CPU storage it has just allocated, then hands
that storage to ``map_location``. :class:`_StagingArchive` notes such a read instead of making it (the CPU
storage is never touched: no page faults), and the ``map_location`` callable reads the noted record through
the ring into the device storage it returns. Anything unexpected (a noted record read for another purpose,
torch refusing a callable ``map_location``, no GPU memory) falls back to the CPU path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from fabric.checkpoint.errors import CorruptCheckpointError
from fabric.checkpoint.integrity import CRC_CHUNK, CheckedArchive, crc32, load_checked, mismatch_message

__all__ = ["BUFFERS", "BUFFER_BYTES", "CudaStaging", "HostStaging", "RingReader", "Staging", "load_staged", "staging_for"]

T = TypeVar("T")
log = logging.getLogger(__name__)

BUFFERS = 4  # pinned host buffers in the ring
BUFFER_BYTES = 8 * 2**20  # each: one host-to-device copy moves up to this much; 32 MiB pinned in all
_STORAGE_RECORD = re.compile(r"(?:^|/)data/[^/]+$")  # "archive/data/0"; not "archive/data.pkl" nor "archive/.data/..."


class Staging(Protocol):
    """The device's part of a staged load (:class:`RingReader` knows nothing of CUDA): host buffers (1-D uint8,
    pinned for a GPU), new device storage, and copies that finish later."""

    def buffers(self) -> Sequence[Tensor]: ...

    def takes(self, location: str) -> bool:
        """Whether a storage saved at ``location`` ("cuda:0", "cpu", ...) is read into device storage."""

    def new_storage(self, nbytes: int) -> torch.UntypedStorage: ...

    def copy(self, source: Tensor, destination: Tensor) -> Any:
        """Start copying ``source`` (part of a buffer: not written again until :meth:`wait`) into ``destination``."""

    def wait(self, handle: Any) -> None: ...

    def to_device(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A device copy of ``storage`` (CPU storage torch has already read and checked); done when it returns."""

    def finish(self) -> None:
        """Every copy done (after the ring drained): the staging may be used on any stream."""


def byte_view(tensor: Tensor) -> memoryview:
    """A writable view of the bytes of the contiguous CPU ``tensor``."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B") if nbytes else memoryview(bytearray())


def as_bytes(storage: torch.UntypedStorage) -> Tensor:
    """``storage`` as a 1-D uint8 tensor (a view, on the storage's device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class RingReader:
    """Reads records of a file (``read_at(view, offset)``: bytes read, 0 at the end) into a ring of host buffers,
    taking the CRC-32 of every byte as it arrives, and hands each filled part to ``staging.copy``. A buffer is read
    into again only once its copies are done, so reading overlaps the copies of the last parts. A damaged record
    raises once its copies are done (its destination then holds unchecked bytes: the caller drops it)."""

    def __init__(
        self,
        read_at: Callable[[memoryview, int], int],
        staging: Staging,
        where: str,
        *,
        crc_chunk: int = CRC_CHUNK,
        crc: Callable[[Any, int], int] = crc32,
    ) -> None:
        self._read_at, self._staging, self._where = read_at, staging, where
        self._buffers = list(staging.buffers())
        if not self._buffers or any(buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() == 0 for buffer in self._buffers):
            raise ValueError("RingReader needs at least one non-empty 1-D uint8 buffer")
        self._views = [byte_view(buffer) for buffer in self._buffers]
        self._size = min(buffer.numel() for buffer in self._buffers)
        self._crc_chunk, self._crc = max(crc_chunk, 1), crc
        self._pending: list[list[Any]] = [[] for _ in self._buffers]  # per buffer, the copies out of it not yet waited for
        self._index, self._fill = 0, 0  # the buffer being filled, and how far

    def read(self, name: str, offset: int, size: int, expected_crc: int, destination: Tensor) -> None:
        """Read record ``name`` (``size`` bytes at ``offset``) through the ring into ``destination`` (uint8, ``size`` long)."""
        if destination.dtype != torch.uint8 or destination.numel() != size:
            raise ValueError(f"the destination of record {name!r} must be {size} uint8 elements, got {destination.numel()} {destination.dtype}")
        try:
            crc, done = 0, 0
            while done < size:
                length = min(size - done, self._size)
                index, start = self._claim(length)
                view = self._views[index][start : start + length]
                got = 0
                while got < length:
                    part = view[got : got + min(self._crc_chunk, length - got)]
                    count = self._read_at(part, offset + done + got)
                    if count <= 0:
                        raise CorruptCheckpointError(f"{self._where} is truncated inside record {name!r}")
                    crc = self._crc(part[:count], crc)
                    got += count
                self._pending[index].append(self._staging.copy(self._buffers[index][start : start + length], destination[done : done + length]))
                done += length
            if crc != expected_crc:
                raise CorruptCheckpointError(mismatch_message(name, size, self._where))
        except BaseException:
            self.drain()  # no copy still reads a buffer, nor writes a destination the caller is about to drop
            raise

    def _claim(self, length: int) -> tuple[int, int]:
        """A place for ``length`` bytes (at most a buffer): the rest of this buffer, else the next, once its copies are done."""
        if self._fill + length > self._size:
            self._index = (self._index + 1) % len(self._buffers)
            self._fill = 0
            self._wait(self._index)
        start = self._fill
        self._fill += length
        return self._index, start

    def _wait(self, index: int) -> None:
        pending = self._pending[index]
        while pending:
            self._staging.wait(pending[0])
            pending.pop(0)

    def drain(self) -> None:
        for index in range(len(self._buffers)):
            self._wait(index)


class HostStaging:
    """:class:`Staging` on the CPU (the tests'): plain buffers, staging in CPU memory, copies done at once."""

    def __init__(self, buffers: int = BUFFERS, buffer_bytes: int = BUFFER_BYTES, takes: Callable[[str], bool] = lambda location: True) -> None:
        self._count, self._bytes, self._takes = buffers, buffer_bytes, takes

    def buffers(self) -> Sequence[Tensor]:
        return [torch.empty(self._bytes, dtype=torch.uint8) for _ in range(self._count)]

    def takes(self, location: str) -> bool:
        return self._takes(location)

    def new_storage(self, nbytes: int) -> torch.UntypedStorage:
        return torch.UntypedStorage(nbytes)

    def copy(self, source: Tensor, destination: Tensor) -> None:
        destination.copy_(source)

    def wait(self, handle: Any) -> None:
        pass

    def to_device(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        return storage.clone()

    def finish(self) -> None:
        pass


class CudaStaging:
    """:class:`Staging` for a CUDA ``device``: pinned buffers (torch's caching host allocator keeps them for the
    next load), staging allocated on the current stream, copies on a side stream, one event per copy. A storage
    saved on the CPU stays there (an optimizer's ``step``, which torch keeps on the CPU unless capturable or fused)."""

    def __init__(self, device: torch.device, buffers: int = BUFFERS, buffer_bytes: int = BUFFER_BYTES) -> None:
        self.device = device
        self._count, self._bytes = buffers, buffer_bytes
        self._current = torch.cuda.current_stream(device)
        self._stream = torch.cuda.Stream(device=device)

    def buffers(self) -> Sequence[Tensor]:
        return [torch.empty(self._bytes, dtype=torch.uint8, pin_memory=True) for _ in range(self._count)]

    def takes(self, location: str) -> bool:
        return not location.startswith("cpu")

    def new_storage(self, nbytes: int) -> torch.UntypedStorage:
        storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        # the memory may have been freed on the current stream by work still queued there: the side stream
        # writes it only after that work (a wait on the device, the CPU does not block)
        self._stream.wait_stream(self._current)
        return storage

    def copy(self, source: Tensor, destination: Tensor) -> torch.cuda.Event:
        with torch.cuda.stream(self._stream):
            destination.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def wait(self, handle: Any) -> None:
        handle.synchronize()

    def to_device(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        return as_bytes(storage).to(self.device).untyped_storage()

    def finish(self) -> None:
        self._stream.synchronize()  # every copy done: the staging can be used (and freed) on any stream


def staging_for(device: torch.device | str | None) -> Staging | None:
    """The :class:`Staging` for loading into objects on ``device``, or None where the CPU path is the one (the
    CPU: reading straight into new storage there is one copy fewer than a ring)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return CudaStaging(device)


class _Fallback(Exception):
    """The staged load cannot go on (an unexpected read, no device memory): the CPU path loads the file."""


class _StagingArchive(CheckedArchive):
    """A :class:`CheckedArchive` that notes a whole read of a storage record instead of making it (see the
    module docstring). Any other read after one was noted, not taken, is unexpected: :class:`_Fallback`."""

    def __init__(self, fd: int, start: int, length: int, where: str) -> None:
        super().__init__(fd, start, length, where)
        self._storage_records = {record.name for record in self._records if _STORAGE_RECORD.search(record.name)}
        self._noted: Any = None  # the storage record whose read was noted, not yet taken
        self.noting = False

    def readinto(self, buffer: Any) -> int:
        if self.noting:
            record = self._by_data.get(self._pos)
            if record is not None and not record.verified and record.name in self._storage_records and memoryview(buffer).nbytes == record.size:
                if self._noted is not None:
                    raise _Fallback(f"storage records {self._noted.name!r} and {record.name!r} were read one after the other")
                self._noted = record
                self._pos += record.size
                return record.size
        if self._noted is not None:
            raise _Fallback(f"storage record {self._noted.name!r} was read and not handed to map_location")
        return super().readinto(buffer)

    def read(self, size: int | None = -1) -> bytes:
        if self._noted is not None:
            raise _Fallback(f"storage record {self._noted.name!r} was read and not handed to map_location")
        return super().read(size)

    def take_noted(self) -> Any:
        noted, self._noted = self._noted, None
        return noted

    def read_noted_into(self, record: Any, destination: Tensor) -> None:
        """Read the noted ``record`` into CPU ``destination`` (its storage), checked as every read is."""
        noting, self.noting = self.noting, False
        try:
            self._read_whole(record, byte_view(destination))
        finally:
            self.noting = noting

    def read_noted_through(self, record: Any, ring: RingReader, destination: Tensor) -> None:
        """Read the noted ``record`` through ``ring`` into ``destination`` (device storage), its CRC checked."""
        try:
            ring.read(record.name, self._start + record.data, record.size, record.crc, destination)
        except CorruptCheckpointError as err:
            raise self._fail(str(err)) from None
        record.verified = self._checked = True


def load_staged(load: Callable[[Any, Any], T], fd: int, length: int, where: str, staging: Staging) -> T:
    """``load(file, map_location)`` (``torch.load``) of the archive of ``length`` bytes in ``fd``, every record's
    CRC checked, each storage ``staging.takes`` read into new device storage through a :class:`RingReader`;
    the others, and the whole file where the staged read cannot be made, as ``load_checked`` does."""
    if sys.byteorder != "little":  # torch swaps a storage's bytes before map_location sees it
        return load_checked(lambda file: load(file, "cpu"), fd, 0, length, where)
    archive = _StagingArchive(fd, 0, length, where)
    byteorder = [name for name in archive.names() if name.endswith("/byteorder")]
    if byteorder and archive.read_record(byteorder[0]) != b"little":
        return load_checked(lambda file: load(file, "cpu"), fd, 0, length, where)
    rings: list[RingReader] = []  # made with the first storage staged: a file with none pins no memory

    def ring() -> RingReader:
        if not rings:
            rings.append(RingReader(lambda view, offset: os.preadv(fd, [view], offset), staging, where))
        return rings[0]

    def place(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        record = archive.take_noted()
        if not staging.takes(location):
            if record is not None:
                archive.read_noted_into(record, as_bytes(storage))
            return storage
        try:
            if record is None:  # read by torch (a record it read in pieces, or one checked with the directory)
                return staging.to_device(storage)
            new = staging.new_storage(record.size)
        except torch.OutOfMemoryError as err:
            raise _Fallback(f"no device memory for the staging: {err}") from None
        archive.read_noted_through(record, ring(), as_bytes(new))
        return new

    archive.noting = True
    try:
        try:
            value = archive.load_with(lambda file: load(file, place))
            if archive.take_noted() is not None:
                raise _Fallback("a storage record was read and not handed to map_location")
        finally:
            for made in rings:
                made.drain()  # every copy done while the staging it writes is still held, whatever happened
        staging.finish()
        return value
    except CorruptCheckpointError:
        raise
    except Exception as err:  # _Fallback, or torch refusing a callable map_location: the CPU path, which reports a bad file
        log.debug("%s: read to the CPU instead of straight to %s: %s", where, getattr(staging, "device", "the device"), err)
    # (outside the handler: the failed attempt's staging is freed before the file is read again)
    return load_checked(lambda file: load(file, "cpu"), fd, 0, length, where)
