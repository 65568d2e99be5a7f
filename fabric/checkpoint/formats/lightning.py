"""Sharded checkpoint folders written by Lightning Fabric: state dicts flattened by torch's default planner
(``optimizer.state.<name>.exp_avg``, ...) and ``meta.pt`` with every other entry, no ``fabric-objects.pt``.

Such a folder is read whole into this process, every tensor in full (as Lightning's ``consolidate_checkpoint``
does), with our folders' reading checks, then loaded as a full file is (``full.FullFile``). Every rank holds the
whole checkpoint for a moment: to save that memory, consolidate once and re-save with fabric.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from fabric.checkpoint.agreement import agree_in_group
from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError, UnsafeCheckpointError
from fabric.checkpoint.formats.file import _weights_only_reason, safe_load
from fabric.checkpoint.formats.format import Load
from fabric.checkpoint.formats.full import FullFile
from fabric.checkpoint.formats.shard_reader import INDEX_FILE, LIGHTNING_META_FILE, OBJECTS_FILE
from fabric.checkpoint.formats.sharded import check_dict_of_states
from fabric.checkpoint.restore import restore
from fabric.checkpoint.storage import Found


class Lightning:
    """Lightning Fabric's folders as the formats' table holds them: DCP's index and ``meta.pt``, no objects file of ours."""

    name = "lightning"

    def claims(self, found: Found) -> bool:
        return found.kind == "folder" and {INDEX_FILE, LIGHTNING_META_FILE} <= found.files and OBJECTS_FILE not in found.files

    def load(self, load: Load) -> Any:
        """Read whole, then loaded as a full file is, into objects of any layout; without a state, the whole checkpoint."""
        state, weights_only = load.state, load.weights_only
        check_dict_of_states(load.store, state)
        reading = load.store.sharded_read()
        try:
            folder = reading.open(())  # (a local folder: Lightning Fabric never wrote to a store)
            if state is None:
                return read_lightning_folder(folder, weights_only)
            assert isinstance(state, dict)  # (check_dict_of_states)
            source = FullFile(load.store, state, weights_only, read_file=lambda: read_lightning_folder(folder, weights_only))
            return restore(source, state, strict=load.strict, agree=agree_in_group)
        finally:
            reading.close()


LIGHTNING = Lightning()


def read_lightning_folder(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """The whole checkpoint in ``path`` (Lightning's layout): its entries, tensors in full, on CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from fabric.checkpoint.formats.shard_reader import SafeFileSystemReader, check_data_files, own_error, quiet_single_process, read_error, read_index

    folder = Path(path)
    index = read_index(folder)
    check_data_files(folder, index)
    meta = safe_load(folder / LIGHTNING_META_FILE, map_location="cpu", weights_only=weights_only)
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{str(folder / LIGHTNING_META_FILE)!r} holds a {type(meta).__name__}, not a dict of entries")
    flat: dict[str, Any] = {  # None: filled by the planner's load_bytes
        key: None if isinstance(saved, BytesStorageMetadata) else torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        for key, saved in index.state_dict_metadata.items()
    }
    planner = _SafeBytesPlanner(weights_only)
    try:
        with quiet_single_process():
            dcp.load(flat, storage_reader=SafeFileSystemReader(folder), planner=planner, no_dist=True)
    except (Exception, dcp.CheckpointException) as err:  # torch's CheckpointException is a BaseException
        refused = own_error(err)  # (one process: its error is the only one)
        if isinstance(refused, UnsafeCheckpointError):
            raise UnsafeCheckpointError(f"Checkpoint {str(folder)!r}: {refused}") from None
        raise read_error(folder, err) from err
    # tensors were read in place; dcp.load hands the planner a copy of the dict, where the other items went
    flat.update({key: planner.state_dict[key] for key, value in flat.items() if value is None})
    checkpoint = _unflatten(flat, index.planner_data or {})
    overlap = sorted(set(checkpoint) & set(meta))
    if overlap:
        raise CheckpointLoadError(f"Checkpoint {str(folder)!r} names {overlap} both in its shards and in {LIGHTNING_META_FILE}")
    checkpoint.update(meta)
    return checkpoint


class _SafeBytesPlanner(DefaultLoadPlanner):
    """torch's planner unpickles non-tensor items (optimizer hyperparameters, ...) with ``weights_only=False``;
    this one with ``weights_only=True`` unless the caller opted out."""

    def __init__(self, weights_only: bool | None) -> None:
        super().__init__(flatten_state_dict=False)
        self._safe = True if weights_only is None else bool(weights_only)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=self._safe)
        except pickle.UnpicklingError as err:
            reason = _weights_only_reason(err)
            if not self._safe or reason is None:
                raise
            raise UnsafeCheckpointError(
                f"the entry {fqn!r} holds an object that can only be restored by running pickled code, which is refused"
                f" by default (load with weights_only=False if you trust the checkpoint): {reason}"
            ) from None


def _unflatten(flat: dict[str, Any], paths: dict[str, Iterable[Any]]) -> dict[str, Any]:
    """Nest ``flat`` (torch's flattened keys) back along the paths the index kept for each key; integer steps
    make lists (``param_groups``)."""
    root: dict[Any, Any] = {}
    for key, value in flat.items():
        path = list(paths.get(key, (key,)))
        node = root
        for step in path[:-1]:
            node = node.setdefault(step, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {key: _lists(value) for key, value in node.items()}
    if items and all(isinstance(key, int) for key in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items
