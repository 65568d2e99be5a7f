"""A checkpoint's life, save and load, in one place (``docs/architecture.md``, Checkpoints): the path becomes a store
once, the format is chosen once from the formats' table (a save: the strategy's; a load: what rank 0 found, which
every rank adopts), and everything is checked before anything changes. The strategy supplies the parts it owns and
is reached only through :class:`CheckpointHost`, its CheckpointIO plugin through ``CheckpointPlugin``: nothing here
imports either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.agreement import on_rank_zero
from fabric.checkpoint.async_save import wait_for_pending_save
from fabric.checkpoint.formats import Load, Save, choose, for_saving
from fabric.checkpoint.host import CheckpointFormat, CheckpointHost
from fabric.checkpoint.per_rank import gather_per_rank_states
from fabric.checkpoint.plugin import CheckpointPlugin, takes_store
from fabric.checkpoint.state import StateFilter
from fabric.checkpoint.stateful import SAVED_RANKS_KEY
from fabric.checkpoint.storage import Found, Store, locate

__all__ = ["CheckpointFormat", "CheckpointHost", "check_checkpoint_io", "load", "save"]


def check_checkpoint_io(checkpoint_format: CheckpointFormat, checkpoint_io: CheckpointPlugin | None, strategy: str) -> None:
    """Refuse a CheckpointIO plugin that ``checkpoint_format`` cannot honour (sharded folders are written by DCP, not
    by a plugin: only one that writes fabric's own format through the store loses nothing)."""
    if checkpoint_format == "sharded" and checkpoint_io is not None and not takes_store(checkpoint_io):
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
    for_saving(host.checkpoint_format).save(Save(host, store, path, state, filter, async_save, storage_options))


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
    wait_for_pending_save()  # the file being written in the background is the one asked for, maybe
    store = locate(path)
    store.before_load()
    found = _agree_on_what_is_there(host, store, collective=isinstance(state, dict))
    rest = choose(found, store, host).load(Load(store, state, strict, weights_only, host, path))
    if isinstance(rest, dict):
        rest.pop(SAVED_RANKS_KEY, None)  # the checkpoint's own record, not the user's
    return rest


def check_path(path: Any, doing: str) -> None:
    """A checkpoint's path is a str or a path-like object (``save(None, ...)`` names the value)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Cannot {doing} a checkpoint at path={path!r} ({type(path).__name__}); accepted: a str or a pathlib.Path")


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
