"""Full checkpoints of sharded objects: one file from rank 0 that plain ``torch.load`` reads.

Saving gathers each tensor in turn and moves it to CPU memory on rank 0 only
(``full_state_dict=True, cpu_offload=True``), so rank 0 holds one full copy in CPU memory beside its
own shard, and the other ranks none. Optimizer states are stored in ``Optimizer.state_dict()``'s
numbered form, so the file loads into a plain model and optimizer too. Loading a full file into a
sharded model hands each rank its part of every tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fabric.plugins.io import atomic_folder, state_layout
from fabric.plugins.io.async_save import wait_for_pending_save
from fabric.plugins.io.single_file import atomic_save, safe_load
from fabric.plugins.io.state_layout import MODULE, OPTIMIZER


def save_full(
    path: str | Path,
    state: dict[str, Any],
    *,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
) -> None:
    """Gather ``state`` and write it from rank 0 as one atomic, ``torch.load``-able file; a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from fabric.plugins.io.sharded import _broadcast, _rank

    wait_for_pending_save()
    entries = state_layout.state_dicts(state, StateDictOptions(full_state_dict=True, cpu_offload=True), filter)
    error = None
    if _rank(None) == 0:
        checkpoint = {
            key: state_layout.optimizer_numbered(value) if state_layout.kind_of(state[key]) == OPTIMIZER else value
            for key, value in entries.items()
        }
        try:
            _write_file(checkpoint, Path(path))
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
    error = _broadcast(error, None)
    if error is not None:
        raise RuntimeError(f"Saving the full checkpoint {str(path)!r} failed; the previous one is kept. {error}")


def _write_file(checkpoint: dict[str, Any], path: Path) -> None:
    if not path.is_dir():
        atomic_save(checkpoint, path)
        return
    # a sharded checkpoint folder is replaced by a file: the same publish-by-renames as for folders
    atomic_folder.prepare_target(path)
    token = atomic_folder.new_token()
    temp = atomic_folder.temp_folder_for(path, token)
    try:
        atomic_save(checkpoint, temp)
        atomic_folder.commit_folder(temp, path, token)
    except BaseException:
        atomic_folder.remove_quietly(temp)
        raise


def load_full(
    path: str | Path,
    state: dict[str, Any] | None,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore ``state`` from a full checkpoint file into objects of any layout; return the rest of the file."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    checkpoint = safe_load(path, map_location="cpu", weights_only=weights_only)
    if state is None:
        return checkpoint
    if not isinstance(checkpoint, dict):
        raise TypeError(f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not a dict of states")
    state_layout.check_entries_present(path, state, checkpoint, strict)
    present = [key for key in state if key in checkpoint]
    named: dict[str, Any] = {}
    for key in present:  # every check first: a misfit changes nothing
        obj, saved = state[key], checkpoint[key]
        kind = state_layout.kind_of(obj)
        if kind == MODULE:
            current = state_layout.state_dicts(state, StateDictOptions(), keys=[key])[key]
            if not isinstance(saved, dict):
                raise TypeError(f"state[{key!r}] is a module but the checkpoint holds a {type(saved).__name__}")
            state_layout.check_module_fits(key, current, state_layout.tensor_shapes(saved), strict)
        elif kind == OPTIMIZER:
            current = state_layout.state_dicts(state, StateDictOptions(), keys=[key])[key]
            named[key] = state_layout.optimizer_named(saved, current, key)
            state_layout.check_optimizer_fits(key, named[key], current)
        else:
            state_layout.check_stateful_entry(key, obj, saved)
    for key in present:
        obj, saved = state[key], checkpoint.pop(key)
        kind = state_layout.kind_of(obj)
        if kind == MODULE:
            set_model_state_dict(obj, saved, options=StateDictOptions(full_state_dict=True, strict=strict))
        elif kind == OPTIMIZER:
            owner = state_layout.owner_of(obj, state, key)
            set_optimizer_state_dict(owner, obj, named[key], options=StateDictOptions(full_state_dict=True))
            for group, saved_group in zip(obj.param_groups, named[key]["param_groups"]):
                # torch's full-state path turns tuples (AdamW's betas) into lists: keep them as saved
                group.update({name: value for name, value in saved_group.items() if name != "params"})
        elif state_layout.is_stateful(obj):
            obj.load_state_dict(saved)
        else:
            state[key] = saved
    return checkpoint
