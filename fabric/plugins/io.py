"""Checkpoint files: atomic writes and safe reads.

A checkpoint on disk is always either the previous file or the new one, whole: we write a temporary
file in the same folder, fsync it, and rename it over the target (rename is atomic on POSIX and
Windows). Reading uses ``weights_only=True`` unless the caller opts out, so a file carrying a pickle
payload cannot run code.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

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
    """``torch.save(obj, path)`` that never leaves a torn file at ``path``.

    Parent folders are created. A crash at any moment leaves the old file (or none) at ``path``; the
    temporary file it may leave behind starts with ``.fabric-tmp-`` and is removed by the next save.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"Cannot save a checkpoint to {str(path)!r}: it is a folder")
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_files(folder, path.name)
    fd, temp_name = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{path.name}.{os.getpid()}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        try:
            os.unlink(temp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)


def _remove_stale_temp_files(folder: Path, name: str) -> None:
    """Delete temp files a crashed save of ``name`` left behind; a live process's file is left alone."""
    for stale in folder.glob(f"{_TEMP_PREFIX}{name}.*"):
        writer = stale.name[len(_TEMP_PREFIX) + len(name) + 1 :].split(".", 1)[0]
        if writer.isdigit() and _process_alive(int(writer)):
            continue
        try:
            stale.unlink()
        except OSError:
            pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    safe = True if weights_only is None else bool(weights_only)
    try:
        return torch.load(path, map_location=map_location, weights_only=safe)
    except pickle.UnpicklingError as err:
        if safe and "weights_only" in str(err):
            raise CheckpointLoadError(
                f"Checkpoint {str(path)!r} holds objects that can only be restored by running pickled code,"
                " which is refused by default. If you trust this file, load it with"
                f" `fabric.load(..., weights_only=False)`. Details: {_first_line(err)}"
            ) from None
        raise CheckpointLoadError(f"Checkpoint {str(path)!r} is corrupt: {_first_line(err)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        raise CheckpointLoadError(
            f"Checkpoint {str(path)!r} could not be read (truncated or corrupt?): {_first_line(err)}"
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
