"""A checkpoint's life, save and load, in one place; the strategy supplies the parts it owns.

Saving: the states that differ between ranks are gathered (``per_rank``), then the strategy's declared
format writes: ``"file"`` (the state dicts the strategy's hooks give, one file from rank 0 through the
CheckpointIO plugin), ``"sharded"`` (a folder in which every rank writes its shards, ``sharded_folder``)
or ``"full"`` (sharded objects gathered into one file from rank 0, ``full_file``). Rank 0's outcome
reaches every rank (``agreement``); files and folders appear whole (``fabric.plugins.io.publish``).

Loading: what is on disk decides, here alone: a folder of shards loads into any layout
(``sharded_folder``); a file loads through the strategy's format (plain state dicts, or full tensors
handed to sharded objects). Everything is checked before anything changes.

The strategy is reached only through :class:`CheckpointHost`, so nothing here imports a strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.agreement import on_every_rank, on_rank_zero
from fabric.checkpoint.async_save import save_in_background, wait_for_pending_save
from fabric.checkpoint.errors import CheckpointLoadError
from fabric.checkpoint.per_rank import gather_per_rank_states
from fabric.checkpoint.restore import restore
from fabric.checkpoint.state import StateDictFile, StateDictHooks, StateFilter, collect_states
from fabric.checkpoint.stateful import SAVED_RANKS_KEY
from fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from fabric.plugins.io.publish import check_loadable, is_sharded_checkpoint, remove_abandoned, remove_abandoned_once
from fabric.plugins.io.storage import is_url, redact

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
    """Write ``state`` to ``path`` in the host's format. A collective: call it on every rank.

    Returns once the checkpoint is published (with ``async_save``: once its tensors are copied off; the
    write's outcome comes with the next save or load); a failure is raised on every rank.
    """
    check_path(path, "save")
    remove_abandoned_once(path)  # the start of a job: what killed saves in this folder left, where the writer is gone
    # the gather's tensors go to this rank's device: NCCL collectives take no CPU tensors
    state = gather_per_rank_states(state, lambda tensor: host.all_gather(tensor.to(host.root_device)), host.world_size, filter)
    checkpoint_format = host.checkpoint_format
    if checkpoint_format != "file":
        if storage_options is not None:
            raise TypeError(f"{type(host).__name__}.save_checkpoint got storage_options={storage_options!r}; it accepts none")
        if checkpoint_format == "sharded":
            from fabric.checkpoint.sharded_folder import save_sharded

            save_sharded(path, state, filter=filter, async_save=async_save)
            return
        if async_save:
            raise ValueError("save(..., async_save=True) needs state_dict_type='sharded'; got state_dict_type='full'")
        from fabric.checkpoint.full_file import save_full

        save_full(path, state, filter=filter, checkpoint_io=host.checkpoint_io)
        return
    checkpoint = collect_states(host, state, filter)

    def write() -> None:
        wait_for_pending_save()
        if async_save:
            save_in_background(host.checkpoint_io, checkpoint, path, storage_options)
        else:
            host.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

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
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Cannot {doing} a checkpoint at path={path!r} ({type(path).__name__}); accepted: a str or a pathlib.Path")


def _load(
    host: CheckpointHost, path: str | Path, state: Module | Optimizer | dict[str, Any] | None, *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    wait_for_pending_save()  # the file being written in the background is the one asked for, maybe
    if not is_url(path):  # (a store has no FIFOs, and a cut save there leaves objects the next save removes)
        check_loadable(path)  # before anything opens it: a FIFO would block forever
        remove_abandoned(path)  # what killed saves in this checkpoint's folder left, where the writer is gone
    if is_sharded_checkpoint(path):  # a folder written by a sharded strategy loads anywhere
        from fabric.checkpoint.sharded_folder import load_sharded

        if isinstance(state, (Module, Optimizer)):
            shown = redact(str(path)) if is_url(path) else str(path)
            raise TypeError(
                f"{shown!r} is a sharded checkpoint folder; load it with fabric.load(path, {{'model': model, ...}})"
                " rather than load_raw()"
            )
        return load_sharded(path, state, strict=strict, weights_only=weights_only)
    if not is_url(path) and Path(path).is_dir() and (host.checkpoint_format != "file" or type(host.checkpoint_io) is TorchCheckpointIO):
        raise CheckpointLoadError(incomplete_folder(Path(path)))  # (a user's CheckpointIO may keep folders)
    if host.checkpoint_format != "file" and isinstance(state, dict):
        from fabric.checkpoint.full_file import load_full  # full tensors into sharded objects

        return load_full(path, state, strict=strict, weights_only=weights_only)
    if state is None:
        return host.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    if isinstance(state, (Module, Optimizer)):  # load_raw: one object, checked before it changes
        read_raw = _reader(host, path, weights_only, {"raw": state}, whole=True)
        source = StateDictFile(host, lambda: {"raw": read_raw()}, path)
        restore(source, {"raw": state}, strict=strict, agree=_alone)
        return {}
    return restore(StateDictFile(host, _reader(host, path, weights_only, state), path), state, strict=strict, agree=partial(_agree_through, host))


def _reader(host: CheckpointHost, path: str | Path, weights_only: bool | None, state: dict[str, Any], whole: bool = False) -> Callable[[], Any]:
    """How the single file is read for ``state``: into new storage on the GPU that ``state``'s modules and
    optimizers live on, where there is one and the plain CheckpointIO reads (``device_load``); else as the
    CheckpointIO reads (on the CPU). ``whole``: the file is the one object's state dict (``load_raw``)."""
    device = staging_device(state.values())
    checkpoint_io = host.checkpoint_io
    if device is None or type(checkpoint_io) is not TorchCheckpointIO:
        return partial(checkpoint_io.load_checkpoint, path, weights_only=weights_only)
    objects = [key for key, obj in state.items() if isinstance(obj, (Module, Optimizer))]

    def read() -> Any:
        from lightning_utilities.core.apply_func import apply_to_collection

        checkpoint = checkpoint_io.load_checkpoint(path, weights_only=weights_only, device=device)
        if not whole and isinstance(checkpoint, dict):  # what is not a module's or optimizer's comes back on the CPU, as before
            for key, value in checkpoint.items():
                if key not in objects:
                    checkpoint[key] = apply_to_collection(value, Tensor, _to_cpu)
        return checkpoint

    return read


def _to_cpu(tensor: Tensor) -> Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def staging_device(objects: Iterable[Any]) -> torch.device | None:
    """The CUDA device every tensor of the modules and optimizers among ``objects`` is on, if there is one."""
    device = None
    for obj in objects:
        if isinstance(obj, Module):
            tensors: Iterable[Tensor] = chain(obj.parameters(), obj.buffers())
        elif isinstance(obj, Optimizer):
            tensors = (param for group in obj.param_groups for param in group["params"])
        else:
            continue
        for tensor in tensors:
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                return None
    return device if device is not None and device.type == "cuda" else None


def incomplete_folder(folder: Path) -> str:
    """Why ``folder`` (not a complete sharded checkpoint) cannot be loaded, naming what it lacks."""
    from fabric.plugins.io.publish import INDEX_FILE

    if not any(folder.iterdir()):
        return f"Checkpoint path {str(folder)!r} is an empty folder, not a checkpoint"
    from fabric.plugins.io.publish import special_kind

    for name in (INDEX_FILE, "fabric-objects.pt"):
        kind = special_kind(folder / name) if (folder / name).is_symlink() else None
        if kind is not None:
            return f"{str(folder)!r} is a sharded checkpoint folder whose {name} is {kind}; it cannot be read"
    lacking = [name for name in (INDEX_FILE, "fabric-objects.pt") if not (folder / name).is_file()]
    return (
        f"{str(folder)!r} is a folder but not a complete sharded checkpoint: it has no {' and no '.join(lacking)}"
        " (a copy that stopped early, or files deleted since); load a complete checkpoint"
    )


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
