"""Full checkpoints of sharded objects: one file from rank 0 that plain ``torch.load`` reads (optimizers in the
numbered form), loaded back into any layout. Saving gathers each tensor in turn into rank 0's CPU memory alone
(docs/architecture.md, "A sharded checkpoint's life").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import fit, layout
from fabric.checkpoint.agreement import agree_in_group, broadcast_in_group, on_rank_zero, rank_in_group
from fabric.checkpoint.async_save import wait_for_pending_save
from fabric.checkpoint.formats.file import safe_load, save_file
from fabric.checkpoint.layout import MODULE, OPTIMIZER, OTHER
from fabric.checkpoint.restore import WholeFile, restore
from fabric.checkpoint.state import collect_states
from fabric.checkpoint.storage import Store, locate
from fabric.plugins.io import CheckpointIO


def save_full(
    path: str | Path,
    state: dict[str, Any],
    *,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
    checkpoint_io: CheckpointIO | None = None,
) -> None:
    """Gather ``state`` and write it from rank 0 as one atomic, ``torch.load``-able file; a collective. The file
    goes through ``checkpoint_io`` (a user's plugin), but a sharded folder at ``path`` is replaced by the file
    with the renames that publish folders."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    wait_for_pending_save()
    store = locate(path, writing="save a checkpoint")
    entries = collect_states(layout.DistributedStateDicts(state, StateDictOptions(full_state_dict=True, cpu_offload=True)), state, filter)

    def write() -> None:  # rank 0 holds the full tensors (cpu_offload): it alone writes
        checkpoint = {
            key: layout.optimizer_numbered(value) if layout.kind_of(state[key]) == OPTIMIZER else value
            for key, value in entries.items()
        }
        try:
            if checkpoint_io is None or store.is_folder():
                save_file(store, checkpoint, replace_folder=True)
            else:
                checkpoint_io.save_checkpoint(checkpoint, path)
        except Exception as err:
            raise RuntimeError(f"Saving the full checkpoint {store.shown!r} failed; the previous one is kept. {type(err).__name__}: {err}") from err

    on_rank_zero(write, rank=rank_in_group(), broadcast=broadcast_in_group)


def load_full(
    path: str | Path | Store,
    state: dict[str, Any] | None,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore ``state`` from a full checkpoint file into objects of any layout; return the rest of the file."""
    if state is None:
        return safe_load(path, map_location="cpu", weights_only=weights_only)
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
            saved, kind = checkpoint[key], layout.kind_of(obj)
            if kind == OTHER:
                fit.check_stateful_entry(key, obj, saved)
                continue
            current = collect_states(layout.DistributedStateDicts(self._state, StateDictOptions()), self._state, keys=[key])[key]
            if kind == MODULE:
                if not isinstance(saved, dict):
                    raise fit.CheckpointMismatchError(f"state[{key!r}] is a module but the checkpoint holds a {type(saved).__name__}")
                fit.check_module_fits(f"the model in state[{key!r}]", current, fit.tensor_shapes(saved), strict)
            else:
                self._named[key] = layout.optimizer_named(saved, current, key)
                fit.check_optimizer_fits(key, self._named[key], current)
                fit.check_optimizer_state_shapes(key, self._named[key]["state"], current["state"])

    def read(self, present: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        values, rest = super().read(present)
        return {key: self._named.get(key, value) for key, value in values.items()}, rest

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, value, options=StateDictOptions(full_state_dict=True, strict=strict))

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        owner = layout.owner_of(optimizer, self._state, key)
        set_optimizer_state_dict(owner, optimizer, value, options=StateDictOptions(full_state_dict=True))
        layout.keep_saved_group_options(optimizer, value)
