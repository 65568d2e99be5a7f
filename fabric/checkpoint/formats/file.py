"""The single-file format: a ``torch.save`` archive, written atomically by the storage layer and read with
``weights_only=True`` unless the caller opts out, so a file carrying a pickle payload cannot run code.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError, UnsafeCheckpointError, is_pickling_error
from fabric.checkpoint.integrity import SMALL_ARCHIVE, load_checked, warn_once
from fabric.checkpoint.storage import Store, locate


def save_file(path: str | Path | Store, obj: Any, replace_folder: bool = False) -> None:
    """``torch.save(obj)`` as the checkpoint file at ``path``, atomically on any store (``Store.write_file``).
    ``replace_folder``: a sharded checkpoint folder there is replaced by the file."""
    store = locate(path, writing="save a checkpoint")
    try:
        store.write_file(lambda file: torch.save(obj, file), replace_folder=replace_folder)
    except Exception as err:
        if is_pickling_error(err):
            raise TypeError(
                f"Could not save the checkpoint {store.shown!r}: the state holds an object that cannot be saved ({err})."
                " Save plain values, tensors and state_dict()s instead; the previous file, if any, is unchanged"
            ) from err
        raise


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` that never leaves a torn file at ``path`` (the previous one or the new one, whole),
    durable when it returns; ``path`` may be a URL (``s3://...``: committed by a record)."""
    save_file(path, obj)


def safe_load(
    path: str | Path | Store, map_location: Any = "cpu", weights_only: bool | None = None, device: torch.device | None = None
) -> Any:
    """``torch.load`` with ``weights_only=True`` unless explicitly disabled, every record's CRC-32 checked as it
    is read (``integrity.load_checked``), and errors that name the file; on a store (``s3://...``) the object's
    size and CRC-32 are first checked against its commit record. With ``device`` (a GPU), storages saved on an
    accelerator are read straight into new storage there (``device_load.load_staged``), the others as
    ``map_location`` says; on a device without a staged path (the CPU) ``device`` changes nothing."""
    safe = True if weights_only is None else bool(weights_only)
    return locate(path).read_file(lambda fd, size, shown: _load(fd, size, shown, map_location, safe, device))


def _load(fd: int, size: int, where: str, map_location: Any, safe: bool, device: torch.device | None) -> Any:
    """A checkpoint held in the open file ``fd``, named ``where`` in messages."""
    if size == 0:
        raise CheckpointLoadError(f"Checkpoint file {where!r} is empty (0 bytes)")
    head = os.pread(fd, 4, 0)
    if not head.startswith(_CHECKPOINT_MAGIC):
        raise CheckpointLoadError(
            f"{where!r} is not a checkpoint file (another kind of file, or a corrupt one): it starts with"
            f" {head!r}, while torch.save writes a zip archive (b'PK...') or a pickle (b'\\x80...')"
        ) from None

    def load(file: Any, where_to: Any = map_location) -> Any:
        return torch.load(file, map_location=where_to, weights_only=safe)

    try:
        if head != _CHECKPOINT_MAGIC[0]:  # torch's legacy format: a pickle, with no checksums to check
            warn_once(
                "legacy format",
                f"{where!r} is in torch's legacy (non-zip) format, which stores no checksums: its bytes cannot be"
                " checked for damage (said once per process)",
            )
            with open(fd, "rb", closefd=False) as file:
                return load(file)
        if device is not None and size > SMALL_ARCHIVE and map_location == "cpu":
            from fabric.checkpoint.formats.device_load import load_staged, staging_for

            staging = staging_for(device)
            if staging is not None:
                return load_staged(load, fd, size, repr(where), staging)
        return load_checked(load, fd, 0, size, repr(where))
    except CorruptCheckpointError as err:
        raise CheckpointLoadError(str(err)) from None
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(err)
        if safe and reason is not None and not reason.startswith("Unsupported operand"):
            raise UnsafeCheckpointError(
                f"Checkpoint {where!r} holds objects that can only be restored by running pickled code,"
                " which is refused by default. If you trust this file, load it with"
                f" `fabric.load(..., weights_only=False)`. Details: {reason}"
            ) from None
        # an unknown pickle opcode means bytes that are no pickle at all: garbage, not a payload
        raise CheckpointLoadError(f"Checkpoint {where!r} is corrupt: {reason or _first_line(err)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        raise CheckpointLoadError(
            f"Checkpoint {where!r} could not be read (truncated or corrupt?): {_first_line(err)}"
        ) from None
    except Exception as err:
        # damaged bytes can derail the unpickler anywhere (IndexError, KeyError, TypeError, ...):
        # still the file's fault, reported as such rather than as a trace from inside torch
        raise CheckpointLoadError(
            f"Checkpoint {where!r} is corrupt: {type(err).__name__}: {_first_line(err)}"
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
