"""Checkpoint files: atomic writes and safe reads.

A checkpoint on disk is always either the previous file or the new one, whole: we write a temporary
file in the same folder, fsync it, and rename it over the target (rename is atomic on POSIX and
Windows). Reading uses ``weights_only=True`` unless the caller opts out, so a file carrying a pickle
payload cannot run code.
"""

from __future__ import annotations

import os
import pickle
import secrets
import stat
import sys
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from fabric._core.processes import process_alive

_TEMP_PREFIX = ".fabric-tmp-"


class CheckpointIO(ABC):
    """Where and how checkpoint dictionaries become files."""

    @abstractmethod
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        ...

    @abstractmethod
    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        ...

    @abstractmethod
    def remove_checkpoint(self, path: str | Path) -> None:
        ...

    def teardown(self) -> None:
        pass


class CheckpointLoadError(RuntimeError):
    """A checkpoint file exists but cannot be read as one (empty, truncated, corrupt or unsafe)."""


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load`` to local paths, made atomic and safe."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"TorchCheckpointIO.save_checkpoint got storage_options={storage_options!r}; it accepts none."
                " Write your own CheckpointIO plugin to use storage options."
            )
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return safe_load(path, map_location=map_location if map_location is not None else "cpu", weights_only=weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` that never leaves a torn file at ``path``, and is durable when it returns.

    Parent folders are created. A crash at any moment leaves the old file (or none) at ``path``; the
    temporary file it may leave behind starts with ``.fabric-tmp-`` and is removed by the next save.

    Durability costs a flush of the whole file to disk. Most of it is hidden: while ``torch.save``
    serializes, every finished stretch of the file is handed to the kernel for writeback at once
    (``sync_file_range``), so the disk works in parallel with the serialization and the final
    ``fdatasync`` only waits for the last few megabytes.
    """
    path = Path(path)
    _check_target(path)
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_files(folder, path.name)
    fd, temp_name = _create_temp_file(folder, path.name)
    try:
        with os.fdopen(fd, "wb", buffering=_WRITE_BUFFER) as file:
            writer = _EarlyWriteback(file)
            torch.save(obj, writer)  # type: ignore[arg-type]
            writer.finish()
        _keep_mode_of(path, temp_name)
        os.replace(temp_name, path)
    except BaseException as err:
        try:
            os.unlink(temp_name)
        except FileNotFoundError:
            pass
        write_error = _write_error(err)
        if write_error is not None:
            # the user knows the target, not our hidden temporary file: name the target
            raise OSError(write_error.errno, f"Could not save the checkpoint {str(path)!r}: {write_error.strerror}"
                          " (the previous file, if any, is unchanged)") from err
        raise
    _fsync_folder(folder)


def _check_target(path: Path) -> None:
    """Only a regular file (or nothing) may be replaced: never a folder, a device, a FIFO or a socket."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError:
        return  # e.g. a component is not a folder: mkdir / open report it naming the path
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"Cannot save a checkpoint to {str(path)!r}: it is a folder")
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ValueError(
            f"Cannot save a checkpoint to {str(path)!r}: it is {kind}; accepted: a regular file or a path that does"
            " not exist yet"
        )


_FILE_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def _write_error(err: BaseException) -> OSError | None:
    """The operating system's write error (disk full, file too large, I/O error) behind ``err``, if any.

    ``torch.save`` reports a failed write of its zip writer as a RuntimeError whose cause is lost; the
    OSError raised by our file object is then its ``__context__``.
    """
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno is not None and err.strerror:
            return err
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
        seen += 1
    return None


# Small writes (zip headers) are gathered; big ones (tensor data) go straight to the kernel.
_WRITE_BUFFER = 1 << 20
# Hand the kernel each stretch of this many bytes for writeback as soon as it is written.
_WRITEBACK_CHUNK = 16 << 20


class _EarlyWriteback:
    """The file object ``torch.save`` writes to: starts the disk writes while serialization goes on.

    Without it, ``torch.save`` fills the page cache and the final sync writes everything at once,
    after serialization: the two costs add up. Started early, they overlap.
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._fd = file.fileno()
        self._written = 0  # bytes handed to ``write``
        self._started = 0  # bytes whose writeback was started
        self._sync_range = _sync_file_range()

    def write(self, data: Any) -> int:
        count = self._file.write(data)
        self._written += count
        if self._sync_range is not None and self._written - self._started >= _WRITEBACK_CHUNK:
            self._file.flush()  # the kernel can only write back what it has
            self._sync_range(self._fd, self._started, self._written - self._started)
            self._started = self._written
        return count

    def flush(self) -> None:
        self._file.flush()

    def finish(self) -> None:
        """Everything on disk (data, and the size needed to read it back)."""
        self._file.flush()
        if hasattr(os, "fdatasync"):
            os.fdatasync(self._fd)
        else:
            os.fsync(self._fd)


_SYNC_FILE_RANGE: Any = None


def _sync_file_range() -> Any:
    """``sync_file_range(fd, offset, nbytes)`` that starts writeback without waiting, or None.

    Linux only (through ctypes: Python does not expose it); elsewhere the final sync does it all.
    """
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is None:
        _SYNC_FILE_RANGE = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                function = libc.sync_file_range
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                function.restype = ctypes.c_int
                write = 2  # SYNC_FILE_RANGE_WRITE: start writing the dirty pages, do not wait

                def start_writeback(fd: int, offset: int, nbytes: int) -> None:
                    function(fd, offset, nbytes, write)  # a failure only means less overlap

                _SYNC_FILE_RANGE = start_writeback
            except (OSError, AttributeError):
                pass
    return _SYNC_FILE_RANGE or None


def _create_temp_file(folder: Path, name: str) -> tuple[int, str]:
    """A new file next to the target, named after it and this process (so stale ones can be told).

    Created with mode 0o666 so the umask applies, as for ``torch.save`` (``mkstemp`` would make it 0o600).
    """
    for _ in range(100):
        temp_name = str(folder / f"{_TEMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            return os.open(temp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), temp_name
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a temporary file next to {str(folder / name)!r}")


def _keep_mode_of(path: Path, temp_name: str) -> None:
    """An existing checkpoint's permissions carry over to its replacement, as an overwrite would keep them."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    try:
        os.chmod(temp_name, mode)
    except OSError:
        pass


def _remove_stale_temp_files(folder: Path, name: str) -> None:
    """Delete temp files a crashed save of ``name`` left behind; a live process's file is left alone."""
    for stale in folder.glob(f"{_TEMP_PREFIX}{name}.*"):
        writer = stale.name[len(_TEMP_PREFIX) + len(name) + 1 :].split(".", 1)[0]
        if not writer.isdigit() or process_alive(int(writer)):
            continue  # another file's temp (e.g. of "name.bak"), or a save still in progress
        try:
            stale.unlink()
        except OSError:
            pass


def _fsync_folder(folder: Path) -> None:
    # the rename itself is only durable once the folder entry is on disk
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_load(path: str | Path, map_location: Any = "cpu", weights_only: bool | None = None) -> Any:
    """``torch.load`` with ``weights_only=True`` unless explicitly disabled, and errors that name the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint file not found: {str(path)!r}")
    if path.is_dir():
        raise IsADirectoryError(f"Checkpoint path {str(path)!r} is a folder, not a file")
    if path.stat().st_size == 0:
        raise CheckpointLoadError(f"Checkpoint file {str(path)!r} is empty (0 bytes)")
    with open(path, "rb") as handle:
        head = handle.read(4)
    if not head.startswith(_CHECKPOINT_MAGIC):
        raise CheckpointLoadError(
            f"{str(path)!r} is not a checkpoint file (another kind of file, or a corrupt one): it starts with"
            f" {head!r}, while torch.save writes a zip archive (b'PK...') or a pickle (b'\\x80...')"
        ) from None
    safe = True if weights_only is None else bool(weights_only)
    try:
        return torch.load(path, map_location=map_location, weights_only=safe)
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(err)
        if safe and reason is not None and not reason.startswith("Unsupported operand"):
            raise CheckpointLoadError(
                f"Checkpoint {str(path)!r} holds objects that can only be restored by running pickled code,"
                " which is refused by default. If you trust this file, load it with"
                f" `fabric.load(..., weights_only=False)`. Details: {reason}"
            ) from None
        # an unknown pickle opcode means bytes that are no pickle at all: garbage, not a payload
        raise CheckpointLoadError(f"Checkpoint {str(path)!r} is corrupt: {reason or _first_line(err)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        raise CheckpointLoadError(
            f"Checkpoint {str(path)!r} could not be read (truncated or corrupt?): {_first_line(err)}"
        ) from None
    except Exception as err:
        # damaged bytes can derail the unpickler anywhere (IndexError, KeyError, TypeError, ...):
        # still the file's fault, reported as such rather than as a trace from inside torch
        raise CheckpointLoadError(
            f"Checkpoint {str(path)!r} is corrupt: {type(err).__name__}: {_first_line(err)}"
        ) from None


# the first bytes of what torch.save writes: a zip archive, or (legacy format) a pickle of protocol >= 2
_CHECKPOINT_MAGIC = (b"PK\x03\x04", b"\x80")


def _weights_only_reason(err: BaseException) -> str | None:
    """The specific line of torch's weights-only refusal (e.g. "Unsupported global: ..."), if it is one."""
    text = str(err)
    if "weights_only" not in text and "WeightsUnpickler" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            line = line.split("WeightsUnpickler error:", 1)[1].strip()
        if "GLOBAL" in line or "nsupported" in line:
            return line
    return lines[0] if lines else ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
