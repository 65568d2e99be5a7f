"""A checkpoint's life, save and load, in one place (``docs/architecture.md``, Checkpoints); the strategy supplies
the parts it owns, and is reached only through :class:`CheckpointHost`, so nothing here imports a strategy. On load,
what the store holds decides, as rank 0 found it, and everything is checked before anything changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.agreement import on_every_rank, on_rank_zero
from fabric.checkpoint.async_save import save_in_background, wait_for_pending_save
from fabric.checkpoint.errors import CheckpointLoadError
from fabric.checkpoint.layout import parameters_and_buffers
from fabric.checkpoint.per_rank import gather_per_rank_states
from fabric.checkpoint.restore import restore
from fabric.checkpoint.state import StateDictFile, StateDictHooks, StateFilter, collect_states
from fabric.checkpoint.stateful import SAVED_RANKS_KEY
from fabric.checkpoint.storage import Found, Store, locate
from fabric.plugins.io import CheckpointIO, TorchCheckpointIO

__all__ = ["CheckpointFormat", "CheckpointHost", "check_checkpoint_io", "load", "save"]

#: How a strategy's checkpoints are written (``Strategy.checkpoint_format``).
CheckpointFormat = Literal["file", "sharded", "full"]

T = TypeVar("T")


class CheckpointHost(StateDictHooks, Protocol):
    """What the pipeline needs of a strategy: its format, its CheckpointIO, its ranks, its device and two collectives."""

    @property
    def checkpoint_format(self) -> CheckpointFormat: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor: ...


def check_checkpoint_io(checkpoint_format: CheckpointFormat, checkpoint_io: CheckpointIO | None, strategy: str) -> None:
    """Refuse a CheckpointIO plugin that ``checkpoint_format`` cannot honour (sharded folders are written by DCP)."""
    if checkpoint_format == "sharded" and checkpoint_io is not None and type(checkpoint_io) is not TorchCheckpointIO:
        raise ValueError(
            f"{strategy} writes sharded checkpoints (a folder of shards, written by torch.distributed.checkpoint),"
            f" which the CheckpointIO plugin {type(checkpoint_io).__name__} cannot write. Remove the plugin, or save"
            " full checkpoints (FSDPStrategy(state_dict_type='full'), ModelParallelStrategy(save_distributed_checkpoint=False))"
        )


def save(
    host: CheckpointHost,
    path: str | Path,
    state: dict[str, Any],
    *,
    filter: StateFilter | None = None,
    async_save: bool = False,
    storage_options: Any | None = None,
) -> None:
    """Write ``state`` to ``path`` in the host's format. A collective: call it on every rank. Returns once the
    checkpoint is published (with ``async_save``: once its tensors are copied off; the write's outcome comes with the
    next save or load); a failure is raised on every rank."""
    check_path(path, "save")
    store = locate(path, writing="save a checkpoint")
    store.before_save()  # the start of a job: what killed saves in this folder left, where the writer is gone
    # the gather's tensors go to this rank's device: NCCL collectives take no CPU tensors
    state = gather_per_rank_states(state, lambda tensor: host.all_gather(tensor.to(host.root_device)), host.world_size, filter)
    checkpoint_format = host.checkpoint_format
    if checkpoint_format != "file":
        if storage_options is not None:
            raise TypeError(f"{type(host).__name__}.save_checkpoint got storage_options={storage_options!r}; it accepts none")
        if checkpoint_format == "sharded":
            from fabric.checkpoint.formats.sharded import save_sharded

            save_sharded(store, state, filter=filter, async_save=async_save)
            return
        if async_save:
            raise ValueError("save(..., async_save=True) needs state_dict_type='sharded'; got state_dict_type='full'")
        from fabric.checkpoint.formats.full import save_full

        save_full(path, state, filter=filter, checkpoint_io=host.checkpoint_io)  # a user's CheckpointIO gets the path
        return
    checkpoint = collect_states(host, state, filter)

    where = store if type(host.checkpoint_io) is TorchCheckpointIO else path  # a user's CheckpointIO gets the path

    def write() -> None:
        wait_for_pending_save()
        if async_save:
            save_in_background(host.checkpoint_io, checkpoint, where, store.shown, storage_options)
        else:
            host.checkpoint_io.save_checkpoint(checkpoint, where, storage_options=storage_options)  # type: ignore[arg-type]

    on_rank_zero(write, rank=host.global_rank, broadcast=lambda outcome: host.broadcast(outcome, src=0))


def load(
    host: CheckpointHost,
    path: str | Path,
    state: Module | Optimizer | dict[str, Any] | None = None,
    *,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore ``state`` in place from ``path`` (a file or a folder of shards); return what it held beyond ``state``."""
    check_path(path, "load")
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"load(..., weights_only={weights_only!r}): accepted values are True, False and None (True)")
    rest = _load(host, path, state, strict=strict, weights_only=weights_only)
    if isinstance(rest, dict):
        rest.pop(SAVED_RANKS_KEY, None)  # the checkpoint's own record, not the user's
    return rest


def check_path(path: Any, doing: str) -> None:
    """A checkpoint's path is a str or a path-like object (``save(None, ...)`` names the value)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Cannot {doing} a checkpoint at path={path!r} ({type(path).__name__}); accepted: a str or a pathlib.Path")


def _load(
    host: CheckpointHost, path: str | Path, state: Module | Optimizer | dict[str, Any] | None, *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    wait_for_pending_save()  # the file being written in the background is the one asked for, maybe
    store = locate(path)
    store.before_load()
    found = _agree_on_what_is_there(host, store, collective=isinstance(state, dict))
    if found.kind in ("sharded", "lightning"):  # a folder written by a sharded strategy loads anywhere
        from fabric.checkpoint.formats.sharded import load_sharded

        if isinstance(state, (Module, Optimizer)):
            raise TypeError(
                f"{store.shown!r} is a sharded checkpoint folder; load it with fabric.load(path, {{'model': model, ...}})"
                " rather than load_raw()"
            )
        return load_sharded(store, state, strict=strict, weights_only=weights_only, found=found)
    if found.kind == "folder" and (host.checkpoint_format != "file" or type(host.checkpoint_io) is TorchCheckpointIO):
        from fabric.checkpoint.formats.sharded import incomplete_folder

        raise CheckpointLoadError(incomplete_folder(store.sharded_read().open()))  # (a user's CheckpointIO may keep folders)
    if host.checkpoint_format != "file" and isinstance(state, dict):
        from fabric.checkpoint.formats.full import load_full  # full tensors into sharded objects

        return load_full(store, state, strict=strict, weights_only=weights_only)
    # our own CheckpointIO reads the store rank 0 looked at (a store's record is not read again); a user's gets the path
    where: str | Path | Store = store if type(host.checkpoint_io) is TorchCheckpointIO else path
    if state is None:
        return host.checkpoint_io.load_checkpoint(where, weights_only=weights_only)  # type: ignore[arg-type]
    if isinstance(state, (Module, Optimizer)):  # load_raw: one object, checked before it changes
        read_raw = _reader(host, where, weights_only, {"raw": state}, whole=True)
        source = StateDictFile(host, lambda: {"raw": read_raw()}, store.shown)
        restore(source, {"raw": state}, strict=strict, agree=_alone)
        return {}
    return restore(StateDictFile(host, _reader(host, where, weights_only, state), store.shown), state, strict=strict, agree=partial(_agree_through, host))


def _agree_on_what_is_there(host: CheckpointHost, store: Store, collective: bool) -> Found:
    """What the location holds, as rank 0 found it, on every rank of a collective load (``load_raw`` and a load
    without state may run on one rank alone: each looks for itself). A store's commit record travels with it."""
    if collective and host.world_size > 1:
        found = on_rank_zero(
            store.detect,
            rank=host.global_rank,
            broadcast=lambda outcome: host.broadcast(outcome, src=0),
            origin="Rank 0 could not open the checkpoint",
        )
    else:
        found = store.detect()
    store.adopt(found)
    return found


def _reader(host: CheckpointHost, path: str | Path | Store, weights_only: bool | None, state: dict[str, Any], whole: bool = False) -> Callable[[], Any]:
    """How the single file is read for ``state``: into new storage on the GPU that ``state``'s modules and
    optimizers live on, where there is one and the plain CheckpointIO reads (``device_load``); else as the
    CheckpointIO reads (on the CPU). ``whole``: the file is the one object's state dict (``load_raw``)."""
    device = staging_device(state.values())
    checkpoint_io = host.checkpoint_io
    if device is None or type(checkpoint_io) is not TorchCheckpointIO:
        return partial(checkpoint_io.load_checkpoint, path, weights_only=weights_only)  # type: ignore[arg-type]
    objects = [key for key, obj in state.items() if isinstance(obj, (Module, Optimizer))]

    def read() -> Any:
        from lightning_utilities.core.apply_func import apply_to_collection

        checkpoint = checkpoint_io.load_checkpoint(path, weights_only=weights_only, device=device)
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


def _alone(step: Callable[[], T], what: str) -> T:
    """No agreement: ``load_raw`` may be called on one rank alone."""
    return step()


def _agree_through(host: CheckpointHost, step: Callable[[], T], what: str) -> T:
    """:func:`agreement.on_every_rank` over the host's own collectives (torch.distributed or Horovod)."""
    if host.world_size == 1:
        return step()

    def failed_ranks(failed: bool) -> list[int]:
        flags = host.all_gather(torch.tensor([int(failed)], device=host.root_device))
        return [rank for rank, flag in enumerate(flags.reshape(-1).tolist()) if flag]

    return on_every_rank(step, failed_ranks=failed_ranks, broadcast=lambda obj, src: host.broadcast(obj, src=src), what=what)
