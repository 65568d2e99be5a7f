"""The single-file format (``SINGLE_FILE``): a ``torch.save`` archive, written atomically by the storage layer and read
with ``weights_only=True`` unless the caller opts out, so a file carrying a pickle payload cannot run code. A strategy
whose ``checkpoint_format`` is "file" saves it from rank 0 through its CheckpointIO plugin and loads it into its
objects through its own hooks (DDP into its wrapped module, Horovod into its optimizer); into a GPU's objects the plain
plugin reads straight onto the device (``device_load``).
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.agreement import on_rank_zero
from fabric.checkpoint.async_save import save_in_background, wait_for_pending_save
from fabric.checkpoint.errors import CheckpointLoadError as CheckpointLoadError  # (importable from here, as before)
from fabric.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError, is_pickling_error
from fabric.checkpoint.fit import check_entry
from fabric.checkpoint.formats.format import Load, Save
from fabric.checkpoint.host import CheckpointHost, HostAgreement, alone
from fabric.checkpoint.integrity import SMALL_ARCHIVE, load_checked, warn_once
from fabric.checkpoint.layout import parameters_and_buffers
from fabric.checkpoint.plugin import takes_store
from fabric.checkpoint.restore import WholeFile, restore
from fabric.checkpoint.state import StateDictHooks, collect_states
from fabric.checkpoint.storage import Found, Store, locate

__all__ = ["SINGLE_FILE", "SingleFile", "StateDictFile", "atomic_save", "safe_load", "save_file", "staging_device"]


class SingleFile:
    """The single-file format as the formats' table holds it: a file (or nothing yet) at the path."""

    name = "file"

    def claims(self, found: Found) -> bool:
        return found.kind in ("file", "missing")

    def save(self, save: Save) -> None:
        """Rank 0 writes the state dicts the host's hooks make, through its CheckpointIO plugin; every rank learns
        the outcome (with ``async_save``: once the tensors are copied off, the write's outcome with the next save)."""
        host, store = save.host, save.store
        checkpoint = collect_states(host, save.state, save.filter)
        plugin = host.checkpoint_io
        where = store if takes_store(plugin) else save.path  # a user's CheckpointIO gets the path

        def write() -> None:
            wait_for_pending_save()
            if save.async_save:
                save_in_background(plugin, checkpoint, where, store.shown, save.storage_options)
            else:
                plugin.save_checkpoint(checkpoint, where, storage_options=save.storage_options)

        on_rank_zero(write, rank=host.global_rank, broadcast=lambda outcome: host.broadcast(outcome, src=0))

    def load(self, load: Load) -> Any:
        """A dict of states (on every rank, agreed) or one module or optimizer (``load_raw``, on this rank alone) from
        the file, checked before it changes, through the host's hooks; without a state, the whole file."""
        host, store, state, weights_only = load.host, load.store, load.state, load.weights_only
        assert host is not None, "chosen for a strategy's load only (formats.choose)"
        plugin = host.checkpoint_io
        # our own plugin reads the store rank 0 looked at (a store's record is not read again); a user's gets the path
        where = store if takes_store(plugin) or load.path is None else load.path
        if state is None:
            return plugin.load_checkpoint(where, weights_only=weights_only)
        if isinstance(state, (Module, Optimizer)):  # load_raw: one object, checked before it changes
            read_raw = _reader(host, where, weights_only, {"raw": state}, whole=True)
            restore(StateDictFile(host, lambda: {"raw": read_raw()}, store.shown), {"raw": state}, strict=load.strict, agree=alone)
            return {}
        source = StateDictFile(host, _reader(host, where, weights_only, state), store.shown)
        return restore(source, state, strict=load.strict, agree=HostAgreement(host))


SINGLE_FILE = SingleFile()


class StateDictFile(WholeFile):
    """A checkpoint of plain state dicts, read whole by a CheckpointIO, as an ``EntrySource``: the strategy's
    hooks load each module and optimizer entry (DDP into its wrapped module, Horovod into its optimizer)."""

    def __init__(self, strategy: StateDictHooks, read: Callable[[], Any], path: str | os.PathLike) -> None:
        super().__init__(path, read)
        self._strategy = strategy

    def check(self, present: dict[str, Any], strict: bool) -> None:
        checkpoint = self.keys()
        for key, obj in present.items():
            check_entry(key, obj, checkpoint[key], strict)

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None:
        self._strategy.load_module_state_dict(module, value, strict=strict)

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None:
        self._strategy.load_optimizer_state_dict(optimizer, value)


def _reader(host: CheckpointHost, path: Any, weights_only: bool | None, state: dict[str, Any], whole: bool = False) -> Callable[[], Any]:
    """How the file is read for ``state``: into new storage on the GPU that ``state``'s modules and optimizers live on,
    where there is one and the plugin takes stores (``device_load``); else as the plugin reads (on the CPU).
    ``whole``: the file is the one object's state dict (``load_raw``)."""
    device = staging_device(state.values())
    plugin = host.checkpoint_io
    if device is None or not takes_store(plugin):
        return partial(plugin.load_checkpoint, path, weights_only=weights_only)
    objects = [key for key, obj in state.items() if isinstance(obj, (Module, Optimizer))]

    def read() -> Any:
        from lightning_utilities.core.apply_func import apply_to_collection

        checkpoint = plugin.load_checkpoint(path, weights_only=weights_only, device=device)
        if not whole and isinstance(checkpoint, dict):  # what is not a module's or optimizer's comes back on the CPU, as before
            for key, value in checkpoint.items():
                if key not in objects:
                    checkpoint[key] = apply_to_collection(value, Tensor, lambda tensor: tensor if tensor.device.type == "cpu" else tensor.cpu())
        return checkpoint

    return read


def staging_device(objects: Iterable[Any]) -> torch.device | None:
    """The CUDA device every tensor of the modules and optimizers among ``objects`` is on, if there is one."""
    devices = {tensor.device for tensor in parameters_and_buffers(objects)}
    device = devices.pop() if len(devices) == 1 else None
    return device if device is not None and device.type == "cuda" else None


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
        raise CorruptCheckpointError(f"Checkpoint file {where!r} is empty (0 bytes)")
    head = os.pread(fd, 4, 0)
    if not head.startswith(_CHECKPOINT_MAGIC):
        raise CorruptCheckpointError(
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
        raise err from None  # (what torch was doing when the check refused the bytes is no part of it)
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(err)
        if safe and reason is not None and not reason.startswith("Unsupported operand"):
            raise UnsafeCheckpointError(
                f"Checkpoint {where!r} holds objects that can only be restored by running pickled code,"
                " which is refused by default. If you trust this file, load it with"
                f" `fabric.load(..., weights_only=False)`. Details: {reason}"
            ) from None
        # an unknown pickle opcode means bytes that are no pickle at all: garbage, not a payload
        raise CorruptCheckpointError(f"Checkpoint {where!r} is corrupt: {reason or _first_line(err)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        raise CorruptCheckpointError(
            f"Checkpoint {where!r} could not be read (truncated or corrupt?): {_first_line(err)}"
        ) from None
    except Exception as err:
        # damaged bytes can derail the unpickler anywhere (IndexError, KeyError, TypeError, ...):
        # still the file's fault, reported as such rather than as a trace from inside torch
        raise CorruptCheckpointError(
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
