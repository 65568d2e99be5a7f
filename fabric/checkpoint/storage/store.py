"""The one storage protocol the checkpoint formats write to and read from: the local disk (``disk.DiskStore``)
and an object store (``object_store.ObjectStore``) implement it, and a format never asks which one it has (how
``detect`` and ``adopt`` make one answer for every rank: "One storage layer" in docs/architecture.md). The stores
derive from these protocols for their defaults (a bare ``return``: mypy takes an empty body for abstract).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

#: What a location holds: nothing, one file, or a folder of files (on a store: a save of several objects).
Kind = Literal["missing", "file", "folder"]


@dataclass(frozen=True)
class Found:
    """What ``Store.detect`` found: facts, of which the formats' table makes a format (picklable: rank 0 sends it to
    every rank). ``files``: a folder's regular files by name (a store's: the objects its commit record lists).
    ``record``: an object store's commit record, so the ranks that adopt it read the checkpoint rank 0 found,
    without reading the record again."""

    kind: Kind
    files: frozenset[str] = frozenset()
    record: Any = None


#: Brings the byte ranges a read needs into the local folder, by file: ``{file: [(offset, length, what it holds),
#: ...]}``; returns the files now there whole (every item of theirs fetched).
Fetch = Callable[[dict[str, list[tuple[int, int, str]]]], set[str]]


@runtime_checkable
class Store(Protocol):
    """A checkpoint's location: the local disk or an object store."""

    #: how every message names the location (a URL without its credentials)
    shown: str

    def detect(self) -> Found:
        """What the location holds; raises for what cannot be read safely (a FIFO, a device, a loop of links)."""

    def adopt(self, found: Found) -> None:
        return  # (by default, nothing is kept between the detection and the read)

    def exists(self) -> bool: ...

    def is_folder(self) -> bool: ...

    def before_save(self) -> None:
        """Clean up once per process what killed saves of this location's folder left (never raises)."""
        return

    def before_load(self) -> None:
        """Clean up what killed saves left (never raises); ``detect`` and ``read_file`` refuse what cannot be opened
        safely (a FIFO would block a read forever)."""
        return

    def write_file(self, produce: Callable[[IO[bytes]], None], replace_folder: bool = False) -> None:
        """``produce(file)`` becomes the checkpoint file here, atomically: the previous checkpoint, whole, until it
        returns. ``replace_folder``: a sharded checkpoint folder here is replaced too (a full save over a sharded one)."""

    def read_file(self, load: Callable[[int, int, str], T]) -> T:
        """``load(fd, size, shown)`` over the checkpoint file here, its bytes checked by the store where it keeps
        a checksum of them (an object store's commit record)."""

    def remove(self) -> None: ...

    def prepare_sharded_save(self, files_written: frozenset[str]) -> str:
        """Rank 0, before a sharded save: clean up and name the save (a ticket every rank passes to :meth:`sharded_save`)."""

    def sharded_save(self, ticket: str) -> ShardedSave: ...

    def sharded_read(self) -> ShardedRead: ...


class ShardedSave(Protocol):
    """One rank's side of one sharded save: ``folder`` is where torch's writer puts this rank's shards (defaults: a
    local folder's). The store moves bytes and keeps their sizes and checksums; what the files are is the format's."""

    folder: Path
    #: said after a local-disk error of the staging folder (where to find room)
    room_hint: str = ""

    def writer(self, nbytes: int) -> Any:
        """torch's storage writer for this rank's ``nbytes`` of shards; its ``written`` keeps where it put each item
        (torch's records of file, offset and length)."""

    def part(self, writer: Any, rank: int) -> dict[str, Any]:
        """What this rank's files are on the store once written, for rank 0's commit (or ``{"error": ..., "raises": <the
        class's name>}``): every file of its folder, sent (a store) or there already (the disk: rank 0 sees them)."""
        return {}

    def commit(self, parts: list[dict[str, Any]], name: str, write: Callable[[IO[bytes]], None]) -> None:
        """Rank 0, given every rank's part: ``write`` the file ``name`` last, then make the save the checkpoint (renames,
        or the commit record)."""

    def describe(self, err: BaseException) -> str:
        """``err``'s message as the save's error repeats it (on a store: its first line, the URL without secrets)."""
        return str(err)

    def abort(self) -> None:
        """Rank 0, after a failed save: remove what it wrote (never raises)."""

    def close(self) -> None:
        """Every rank: remove this rank's staging (never raises)."""
        return


class ShardedRead(Protocol):
    """A sharded checkpoint opened for reading, as a local folder; ``fetch`` brings the items a read needs into it
    (None, the default: the folder holds every file already). Facts only: the format checks what they mean."""

    shown: str
    fetch: Fetch | None = None

    def open(self, names: Collection[str]) -> Path:
        """The local folder, holding the files ``names`` whole (a store's fetched and checked against its record)."""

    def recorded(self) -> tuple[str, dict[str, int]] | None:
        """(the save's name, each file's size) as the store's commit record keeps them; None for a local folder,
        whose files are all there is."""
        return None

    def expect_items(self, spans: dict[str, list[tuple[int, int]]]) -> None:
        """Every item a read may fetch, by file (``(offset, length)``): a store whose record keeps no checksum for
        each refuses them here (``CorruptCheckpointError``), before anything is read."""
        return

    def naming(self) -> AbstractContextManager[None]:
        """Errors of the local checks name the checkpoint, not a staging folder."""
        return nullcontext()

    def close(self) -> None:
        return
