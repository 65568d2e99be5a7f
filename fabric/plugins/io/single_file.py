"""Checkpoint files: the CheckpointIO plugin, written atomically (``publish``) and read safely.

Reading uses ``weights_only=True`` unless the caller opts out, so a file carrying a pickle payload cannot
run code.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError, UnsafeCheckpointError
from fabric.plugins.io.integrity import SMALL_ARCHIVE, load_checked, say_once_nothing_to_check
from fabric.plugins.io.publish import atomic_save, check_loadable
from fabric.plugins.io.storage import is_url, local_or_url


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


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load`` to local paths, made atomic and safe."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"TorchCheckpointIO.save_checkpoint got storage_options={storage_options!r}; it accepts none."
                " Write your own CheckpointIO plugin to use storage options."
            )
        if is_url(path):
            from fabric.plugins.io.storage import save_file

            save_file(checkpoint, str(path))
            return
        atomic_save(checkpoint, local_or_url(path))

    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        device: torch.device | None = None,
    ) -> dict[str, Any]:
        """``safe_load``; ``device`` (a GPU the loaded values are for): the storages saved on an accelerator are
        read into new storage there, overlapping the read, the CRC and the copy (``device_load``)."""
        return safe_load(path, map_location=map_location if map_location is not None else "cpu", weights_only=weights_only, device=device)

    def remove_checkpoint(self, path: str | Path) -> None:
        if is_url(path):
            from fabric.plugins.io.storage import remove

            remove(str(path))
            return
        path = Path(local_or_url(path))
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        elif path.exists():
            path.unlink()




def safe_load(path: str | Path, map_location: Any = "cpu", weights_only: bool | None = None, device: torch.device | None = None) -> Any:
    """``torch.load`` with ``weights_only=True`` unless explicitly disabled, every record's CRC-32 checked as it
    is read (``integrity.load_checked``), and errors that name the file.

    With ``device`` (a GPU), storages saved on an accelerator are read into new storage on ``device``
    through pinned buffers, read, CRC and copy overlapping (``device_load.load_staged``), and the others as
    ``map_location`` says; on a device without a staged path (the CPU) ``device`` changes nothing.

    A URL (``s3://...``) is read through its commit record (``storage.load_file``): the object's size and
    CRC-32 are checked against the record, then it is loaded from memory by the same checked path."""
    safe = True if weights_only is None else bool(weights_only)
    if is_url(path):
        from fabric.plugins.io.storage import load_file

        return load_file(str(path), lambda fd, size, where: _load_fd(fd, size, where, map_location, safe, device))
    path = Path(local_or_url(path))
    check_loadable(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint file not found: {str(path)!r}")
    if path.is_dir():
        raise IsADirectoryError(f"Checkpoint path {str(path)!r} is a folder, not a file")
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise CheckpointLoadError(f"Checkpoint file {str(path)!r} is empty (0 bytes)")
        head = file.read(4)
        if not head.startswith(_CHECKPOINT_MAGIC):
            raise CheckpointLoadError(
                f"{str(path)!r} is not a checkpoint file (another kind of file, or a corrupt one): it starts with"
                f" {head!r}, while torch.save writes a zip archive (b'PK...') or a pickle (b'\\x80...')"
            ) from None
        return _load(file.fileno(), size, path, map_location, safe, legacy=head != _CHECKPOINT_MAGIC[0], device=device)


def _load_fd(fd: int, size: int, where: str, map_location: Any, safe: bool, device: torch.device | None) -> Any:
    """A checkpoint held in the open file ``fd`` (a store's object read into memory), named ``where``."""
    head = os.pread(fd, 4, 0)
    if size == 0 or not head.startswith(_CHECKPOINT_MAGIC[0]):
        raise CheckpointLoadError(f"{where!r} is not a checkpoint archive written by torch.save: it starts with {head!r}")
    return _load(fd, size, where, map_location, safe, legacy=False, device=device)


def _load(fd: int, size: int, path: str | Path, map_location: Any, safe: bool, legacy: bool, device: torch.device | None = None) -> Any:
    try:
        if legacy:  # torch's legacy format: a pickle, with no checksums to check
            say_once_nothing_to_check(path)
            return torch.load(path, map_location=map_location, weights_only=safe)
        if device is not None and size > SMALL_ARCHIVE and map_location == "cpu":
            from fabric.plugins.io.device_load import load_staged, staging_for

            staging = staging_for(device)
            if staging is not None:
                return load_staged(
                    lambda archive, where_to: torch.load(archive, map_location=where_to, weights_only=safe), fd, size, repr(str(path)), staging
                )
        return load_checked(
            lambda archive: torch.load(archive, map_location=map_location, weights_only=safe),
            fd,
            0,
            size,
            repr(str(path)),
        )
    except CorruptCheckpointError as err:
        raise CheckpointLoadError(str(err)) from None
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(err)
        if safe and reason is not None and not reason.startswith("Unsupported operand"):
            raise UnsafeCheckpointError(
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
