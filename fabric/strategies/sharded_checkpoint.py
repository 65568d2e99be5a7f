"""Checkpoints of sharded modules: a folder in which every rank writes its own shards.

The folder holds a ``torch.distributed.checkpoint`` (DCP) save of the modules and optimizers (each
rank writes the shards it holds, in parallel) and ``fabric_state.pt``, rank 0's single file with
everything else (step counters, a loader's positions), read back safely. DCP's own resharding lets a
folder written by N ranks load into M.

Only the two functions at the bottom touch the disk, so a richer checkpoint IO can take their place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

OTHER_STATE_FILE = "fabric_state.pt"
_TEMP_PREFIX = ".fabric-tmp-"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A folder written by :func:`write_sharded` (it has DCP's ``.metadata``)."""
    return (Path(path) / ".metadata").is_file()


def checkpoint_keys(path: str | Path) -> set[str]:
    """Top-level keys of the sharded part of the checkpoint at ``path`` (from DCP's metadata, without loading)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def write_sharded(path: str | Path, sharded: dict[str, Any], other: dict[str, Any]) -> None:
    """Write ``sharded`` (state dicts of DTensors) with every rank and ``other`` from rank 0, into folder ``path``.

    Everything goes into a temporary folder beside ``path`` first, which then replaces ``path``: a crash
    while writing leaves the previous checkpoint as it was. Call it on every rank.
    """
    import torch.distributed.checkpoint as dcp

    from fabric.plugins.io import atomic_save

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"Cannot save a sharded checkpoint to {str(path)!r}: it is a file, and the checkpoint is a folder")
    rank = dist.get_rank()
    box = [f"{_TEMP_PREFIX}{path.name}-{os.urandom(4).hex()}" if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one temporary folder for all ranks
    temp = path.parent / str(box[0])
    if rank == 0:
        temp.mkdir(parents=True)
    dist.barrier()
    try:
        dcp.save(sharded, checkpoint_id=str(temp))
        if rank == 0:
            atomic_save(other, temp / OTHER_STATE_FILE)
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        _replace_folder(temp, path)
    dist.barrier()


def read_sharded(path: str | Path, targets: dict[str, Any], strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
    """Fill ``targets`` (state dicts shaped like the live, sharded objects) in place; return the other entries.

    With ``strict=False`` entries of ``targets`` that the checkpoint lacks keep their values.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from fabric.plugins.io import safe_load

    if targets:
        dcp.load(targets, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=not strict))
    return safe_load(Path(path) / OTHER_STATE_FILE, map_location="cpu", weights_only=weights_only)


def _replace_folder(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target``; an older folder there is moved aside first and removed after."""
    old = None
    if target.exists():
        old = target.parent / f"{_TEMP_PREFIX}{target.name}-old-{os.urandom(4).hex()}"
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
