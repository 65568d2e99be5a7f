"""Full checkpoints of sharded objects: one file from rank 0 that plain ``torch.load`` reads (optimizers in the
numbered form), loaded back into any layout. Saving gathers each tensor in turn into rank 0's CPU memory alone
(docs/architecture.md, "A sharded checkpoint's life").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint.agreement import agree_in_group, broadcast_in_group, on_rank_zero, rank_in_group
from fabric.checkpoint.async_save import wait_for_pending_save
from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.fit import check_module_fits, check_optimizer_fits, check_optimizer_state_shapes, check_stateful_entry, tensor_shapes
from fabric.checkpoint.formats.file import SINGLE_FILE, safe_load, save_file
from fabric.checkpoint.formats.format import Load, Save
from fabric.checkpoint.layout import (
    MODULE,
    OPTIMIZER,
    OTHER,
    DistributedStateDicts,
    keep_saved_group_options,
    kind_of,
    module_in_state,
    optimizer_named,
    optimizer_numbered,
)
from fabric.checkpoint.plugin import CheckpointPlugin, takes_store
from fabric.checkpoint.restore import WholeFile, restore
from fabric.checkpoint.state import collect_states
from fabric.checkpoint.storage import Found, Store, locate


class Full:
    """The "full" format as the formats' table holds it: one file (``SINGLE_FILE``'s bytes) of full tensors, gathered
    from sharded objects on saving and handed back to objects of any layout on loading."""

    name = "full"

    def claims(self, found: Found) -> bool:
        return SINGLE_FILE.claims(found)

    def save(self, save: Save) -> None:
        save.refuse_storage_options()
        if save.async_save:
            raise ValueError("save(..., async_save=True) needs state_dict_type='sharded'; got state_dict_type='full'")
        save_full(save.path, save.state, filter=save.filter, checkpoint_io=save.host.checkpoint_io)

    def load(self, load: Load) -> Any:
        """A dict of states: full tensors into objects of any layout, through torch's distributed state-dict API; the
        whole file, or one object (``load_raw``), as the strategy reads a single file."""
        if load.host is not None and not isinstance(load.state, dict):
            return SINGLE_FILE.load(load)
        return load_full(load.store, load.state, strict=load.strict, weights_only=load.weights_only)


FULL = Full()


def save_full(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
    checkpoint_io: CheckpointPlugin | None = None,
) -> None:
    """Gather ``state`` and write it from rank 0 as one atomic, ``torch.load``-able file; a collective. The file
    goes through ``checkpoint_io`` (a user's plugin), but a sharded folder at ``path`` is replaced by the file
    with the renames that publish folders."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    wait_for_pending_save()
    store = locate(path, writing="save a checkpoint")
    entries = collect_states(DistributedStateDicts(state, StateDictOptions(full_state_dict=True, cpu_offload=True)), state, filter)

    def write() -> None:  # rank 0 holds the full tensors (cpu_offload): it alone writes
        checkpoint = {key: optimizer_numbered(value) if kind_of(state[key]) == OPTIMIZER else value for key, value in entries.items()}
        try:
            if checkpoint_io is None or store.is_folder():
                save_file(store, checkpoint, replace_folder=True)
            else:
                checkpoint_io.save_checkpoint(checkpoint, store if takes_store(checkpoint_io) else path)
        except Exception as err:
            raise RuntimeError(f"Saving the full checkpoint {store.shown!r} failed; the previous one is kept. {type(err).__name__}: {err}") from err

    on_rank_zero(write, rank=rank_in_group(), broadcast=broadcast_in_group)


def load_full(
    path: str | Path | Store,
    state: Module | Optimizer | dict[str, Any] | None,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore ``state`` from a full checkpoint file into objects of any layout; return the rest of the file."""
    if state is None:
        return safe_load(path, map_location="cpu", weights_only=weights_only)
    if not isinstance(state, dict):
        raise CheckpointMismatchError(
            f"Loading the checkpoint {locate(path).shown!r} into sharded objects needs a dict of states such as"
            f" {{'model': model, 'optimizer': optimizer}}, got a {type(state).__name__}"
        )
    return restore(FullFile(path, state, weights_only), state, strict=strict, agree=agree_in_group)


class FullFile(WholeFile):
    """A full checkpoint file as an ``EntrySource``: whole tensors, handed to sharded objects (each rank keeps its
    part) through torch's distributed state-dict API. ``read_file`` reads it (default: the file at ``path``, safely)."""

    def __init__(
        self,
        path: str | Path | Store,
        state: dict[str, Any],
        weights_only: bool | None,
        read_file: Callable[[], Any] | None = None,
    ) -> None:
        store = locate(path)
        super().__init__(store.shown, read_file or (lambda: safe_load(store, map_location="cpu", weights_only=weights_only)))
        self._state = state
        self._named: dict[str, Any] = {}  # optimizer entries renamed after this job's parameter names

    def check(self, present: dict[str, Any], strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        checkpoint = self.keys()
        for key, obj in present.items():
            saved, kind = checkpoint[key], kind_of(obj)
            if kind == OTHER:
                check_stateful_entry(key, obj, saved)
                continue
            hooks = DistributedStateDicts(self._state, StateDictOptions(), error=CheckpointMismatchError)
            current = collect_states(hooks, self._state, keys=[key])[key]
            if kind == MODULE:
                if not isinstance(saved, dict):
                    raise CheckpointMismatchError(f"state[{key!r}] is a module but the checkpoint holds a {type(saved).__name__}")
                check_module_fits(f"the model in state[{key!r}]", current, tensor_shapes(saved), strict)
            else:
                self._named[key] = optimizer_named(saved, current, key)
                check_optimizer_fits(key, self._named[key], current)
                check_optimizer_state_shapes(key, self._named[key]["state"], current["state"])

    def read(self, present: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        values, rest = super().read(present)
        return {key: self._named.get(key, value) for key, value in values.items()}, rest

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, value, options=StateDictOptions(full_state_dict=True, strict=strict))

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        module = module_in_state(optimizer, self._state, key, CheckpointMismatchError)
        set_optimizer_state_dict(module, optimizer, value, options=StateDictOptions(full_state_dict=True))
        keep_saved_group_options(optimizer, value)
