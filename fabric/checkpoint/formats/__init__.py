"""Checkpoint formats, one module each, and the one table that chooses among them (docs/architecture.md,
"Checkpoints"): what the bytes of a checkpoint are and how they are read back; where they go (a local disk or a
store) is ``fabric.checkpoint.storage``'s, which reports what a location holds (``Found``) and nothing more.

======================  ==============================  ============================================================
format (object)          saved by                        chosen for a load when the location holds
======================  ==============================  ============================================================
"file" (``SINGLE_FILE``) a strategy with checkpoint      a file (or nothing yet), for a strategy writing "file"
                         format "file": rank 0, through
                         its CheckpointIO plugin
"full" (``FULL``)        a sharded strategy with "full": a file (or nothing yet), for a sharded strategy or none
                         full tensors, from rank 0       (``load_sharded``, consolidate)
"sharded" (``SHARDED``)  a sharded strategy: every rank  a folder with DCP's index and fabric's objects file
                         its shards, in parallel
"lightning"              Lightning Fabric                a folder with DCP's index and Lightning's ``meta.pt``
======================  ==============================  ============================================================

A format is chosen once per save (by the strategy's ``checkpoint_format``) and once per load (by what rank 0 found,
which every rank adopts); ``load``, ``load_sharded`` and ``fabric-torch consolidate`` all choose here. The format
modules are imported when first chosen (``torch.distributed.checkpoint`` costs ~0.5 s).
"""

from __future__ import annotations

import os
from typing import Any

from fabric.checkpoint.agreement import broadcast_in_group, on_rank_zero, rank_in_group
from fabric.checkpoint.async_save import wait_for_pending_save
from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError
from fabric.checkpoint.formats.format import Format, Load, Save, SavingFormat
from fabric.checkpoint.host import CheckpointFormat, CheckpointHost
from fabric.checkpoint.plugin import takes_store
from fabric.checkpoint.storage import Found, Store, locate

__all__ = ["Format", "Load", "Save", "SavingFormat", "choose", "for_saving", "load_sharded"]


def for_saving(checkpoint_format: CheckpointFormat) -> SavingFormat:
    """The format a strategy whose ``checkpoint_format`` is this saves in."""
    if checkpoint_format == "sharded":
        from fabric.checkpoint.formats.sharded import SHARDED

        return SHARDED
    if checkpoint_format == "full":
        from fabric.checkpoint.formats.full import FULL

        return FULL
    from fabric.checkpoint.formats.file import SINGLE_FILE

    return SINGLE_FILE


def choose(found: Found, store: Store, host: CheckpointHost | None = None) -> Format:
    """The one format that reads what ``found`` says ``store`` holds, for ``host``'s objects (None: objects of any
    layout, torch.distributed's group). A folder written by a sharded save loads anywhere; a file loads as the host
    saves files; a folder no format claims is refused naming what it lacks (a user's CheckpointIO plugin on a "file"
    strategy is handed it: it may keep its checkpoints in folders)."""
    if found.kind == "folder":
        from fabric.checkpoint.formats.lightning import LIGHTNING
        from fabric.checkpoint.formats.sharded import SHARDED

        for candidate in (SHARDED, LIGHTNING):
            if candidate.claims(found):
                return candidate
    single = for_saving("file" if host is not None and host.checkpoint_format == "file" else "full")  # (what a file is to them)
    if single.claims(found) or (single.name == "file" and host is not None and not takes_store(host.checkpoint_io)):
        return single
    raise _incomplete_folder(store)


def load_sharded(
    path: str | os.PathLike | Store,
    state: dict[str, Any] | None = None,
    strict: bool = True,
    weights_only: bool | None = None,
    found: Found | None = None,
) -> Any:
    """Restore ``state`` in place from a sharded checkpoint (or a full checkpoint file, or Lightning Fabric's folder)
    into objects of any layout, checked and read on every rank before any rank changes anything; return what was not
    asked for (without ``state``: the whole checkpoint, tensors in full). ``found``: what the location holds, as every
    rank agreed (``Store.detect`` on rank 0), else detected here (on rank 0 for a collective load, a dict ``state``)."""
    wait_for_pending_save()
    store = locate(path)
    if found is None and isinstance(state, dict):  # a collective: every rank reads what rank 0 found (one checkpoint for all)
        found = on_rank_zero(store.detect, rank=rank_in_group(), broadcast=broadcast_in_group, origin="Rank 0 could not open the checkpoint")
    elif found is None:
        found = store.detect()
    store.adopt(found)
    return choose(found, store).load(Load(store, state, strict, weights_only))


def _incomplete_folder(store: Store) -> CheckpointLoadError:
    """Why the folder at ``store`` (no complete checkpoint of any format) cannot be loaded, naming what it lacks."""
    from fabric.checkpoint.formats.shard_reader import INDEX_FILE, OBJECTS_FILE
    from fabric.checkpoint.storage.disk import special_kind

    reading = store.sharded_read()
    try:
        with reading.naming():
            folder = reading.open(())
            if not any(folder.iterdir()):
                return CheckpointLoadError(f"Checkpoint path {store.shown!r} is an empty folder, not a checkpoint")
            for name in (INDEX_FILE, OBJECTS_FILE):
                kind = special_kind(folder / name) if (folder / name).is_symlink() else None
                if kind is not None:
                    return CorruptCheckpointError(f"{store.shown!r} is a sharded checkpoint folder whose {name} is {kind}; it cannot be read")
            lacking = [name for name in (INDEX_FILE, OBJECTS_FILE) if not (folder / name).is_file()]
            return CorruptCheckpointError(
                f"{store.shown!r} is a folder but not a complete sharded checkpoint: it has no {' and no '.join(lacking)}"
                " (a copy that stopped early, or files deleted since); load a complete checkpoint"
            )
    finally:
        reading.close()
