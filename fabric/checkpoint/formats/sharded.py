"""Sharded checkpoints: a folder in which every rank writes its own shards, readable by any layout (2 -> 4
processes, sharded -> a plain module in one process, and back), one flow for every store (docs/architecture.md:
"A sharded checkpoint's life", "A sharded checkpoint on a store"). Beside torch.distributed.checkpoint's files
(tensors only), rank 0 writes ``fabric-objects.pt`` (``weights_only``-loadable): every non-tensor value, where
each tensor belongs (``layout``), and what binds the save's files.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import fit, layout
from fabric.checkpoint.agreement import agree_in_group, broadcast_in_group, gather_in_group, on_rank_zero, rank_in_group
from fabric.checkpoint.async_save import (
    SaveHandle,
    background_group,
    finished,
    start_background_save,
    wait_for_pending_save,
)
from fabric.checkpoint.errors import CheckpointLoadError
from fabric.checkpoint.formats.file import safe_load
from fabric.checkpoint.formats.full import FullFile, load_full
from fabric.checkpoint.formats.lightning import read_lightning_folder
from fabric.checkpoint.formats.shard_reader import (
    INDEX_FILE,
    OBJECTS_FILE,
    Fetch,
    SafeFileSystemReader,
    check_index_crc,
    first_failure,
    own_error,
    quiet_single_process,
    read_index,
)
from fabric.checkpoint.layout import MODULE, OPTIMIZER, OTHER
from fabric.checkpoint.restore import restore
from fabric.checkpoint.state import collect_states
from fabric.checkpoint.storage import Found, ShardedRead, Store, disk, locate

FORMAT = "fabric-sharded-checkpoint"
VERSION = 1


def save_sharded(
    path: str | Path | Store,
    state: dict[str, Any],
    *,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
    async_save: bool = False,
) -> SaveHandle:
    """Write ``state`` (modules, plain, DDP or ``fully_shard``-ed; optimizers, saved with the module in ``state``
    that holds their parameters; stateful objects; plain values) to the folder ``path``: every rank its own
    shards, in parallel; a collective. With ``async_save`` it returns once the tensors are copied to CPU memory;
    the handle's ``wait()`` returns when the checkpoint is published on every rank (raising its error if any)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    wait_for_pending_save()
    store = locate(path, writing="save a checkpoint")
    entries = collect_states(layout.DistributedStateDicts(state, StateDictOptions()), state, filter)
    kinds = {key: layout.kind_of(obj) for key, obj in state.items()}
    skeleton, tensors, paths = layout.split_tensors(entries, kinds)
    objects = {"format": FORMAT, "version": VERSION, "kinds": kinds, "skeleton": skeleton, "tensors": paths}
    # rank 0 cleans up after crashed saves and names this save; every rank gets the name
    ticket = on_rank_zero(
        partial(store.prepare_sharded_save, _files_written()), rank=rank_in_group(), broadcast=broadcast_in_group
    )
    if async_save:
        staged = {flat: layout.plain_copy(tensor) for flat, tensor in tensors.items()}
        group = background_group()
        return start_background_save(lambda: _write(store, ticket, staged, objects, group=group), repr(store.shown))
    _write(store, ticket, tensors, objects, group=None)
    return finished()


def _files_written() -> frozenset[str]:
    """The data files a save by this job writes into a local folder (torch's writer: one per rank), so a reused
    folder keeps them to be overwritten and drops the rest (its old index, shards of a run with more processes)."""
    _, world_size = _rank_and_world_size() or (0, 1)
    return frozenset({OBJECTS_FILE, *(f"__{rank}_0.distcp" for rank in range(world_size))})


def _write(store: Store, ticket: str, tensors: dict[str, Tensor], objects: dict[str, Any], group: Any) -> None:
    """Every rank writes its shards; rank 0 gathers each rank's part (or error), writes the objects file, commits; all learn the outcome."""
    save = store.sharded_save(ticket)
    failed = f"Saving the sharded checkpoint {store.shown!r} failed; the previous one is kept."
    rank = rank_in_group(group)
    try:
        nbytes = sum(local.numel() * local.element_size() for local in map(_local, tensors.values()))  # this rank's part
        try:
            writer = save.writer(nbytes)
            with quiet_single_process():
                dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not _distributed())
        except (Exception, dcp.CheckpointException) as err:  # torch gathers every rank's failure (a BaseException)
            part: dict[str, Any] = {"error": f"writing the shards failed {first_failure(err)}",
                                    "raises": "TimeoutError" if _timed_out(err) else "RuntimeError"}
            # torch's message for a full disk ("unexpected pos 704 vs 598") never names it: look at the free space
            full = disk.out_of_space(save.folder, nbytes)
            if full is not None:
                part["error"] = f"{full}{save.room_hint}; {part['error']}"
        else:
            part = save.part(writer, rank)
        parts = gather_in_group(part, group)

        def commit() -> None:
            assert parts is not None
            first = next((part for part in parts if "error" in part), None)
            if first is not None:
                raise _PART_ERRORS[first["raises"]](f"{failed} {first['error']}")
            try:
                binding = save.binding(parts)
                save.commit(lambda file: torch.save({**objects, **binding}, file))
            except Exception as err:
                error = TimeoutError if _timed_out(err) else RuntimeError
                raise error(f"{failed} {type(err).__name__}: {save.describe(err)}") from err

        try:
            on_rank_zero(commit, rank=rank, broadcast=partial(broadcast_in_group, group=group))
        except Exception:
            if rank == 0:
                save.abort()
            raise
    finally:
        save.close()


# the class a rank's failed part names (it crosses ranks as a string): a store out of reach gives the class a
# single-file save gives, TimeoutError or another OSError
_PART_ERRORS: dict[str, type[Exception]] = {"TimeoutError": TimeoutError, "OSError": OSError, "RuntimeError": RuntimeError}


def _timed_out(err: BaseException) -> bool:
    """Whether a rank's error came from a store call that got no answer within its bound: the save then raises a
    ``TimeoutError`` on every rank, as a single-file save does."""
    seen: set[int] = set()
    current: BaseException | None = own_error(err)
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TimeoutError):
            return True
        current = current.__cause__ or current.__context__
    return False


def load_sharded(
    path: str | Path | Store,
    state: dict[str, Any] | None = None,
    strict: bool = True,
    weights_only: bool | None = None,
    found: Found | None = None,
) -> dict[str, Any]:
    """Restore ``state`` in place from a sharded checkpoint (or a full checkpoint file) into objects of any
    layout, checked and read on every rank before any rank changes anything (``restore``); return what was not
    asked for (without ``state``: the whole checkpoint, tensors in full). ``found``: what the location holds, as
    every rank agreed (``Store.detect`` on rank 0), else detected here."""
    wait_for_pending_save()
    store = locate(path)
    if found is None and isinstance(state, dict):  # a collective: every rank reads what rank 0 found (one checkpoint for all)
        found = on_rank_zero(store.detect, rank=rank_in_group(), broadcast=broadcast_in_group, origin="Rank 0 could not open the checkpoint")
    elif found is None:
        found = store.detect()
    store.adopt(found)
    if found.kind in ("file", "missing"):
        return load_full(store, state, strict=strict, weights_only=weights_only)
    if found.kind == "lightning":  # Lightning Fabric's layout: read whole, then loaded as a full file is
        folder = store.sharded_read().open()  # (a local folder: Lightning Fabric never wrote to a store)
        if state is None:
            return read_lightning_folder(folder, weights_only)
        if not isinstance(state, dict):
            raise TypeError(f"Loading the sharded checkpoint {store.shown!r} needs a dict of states, got a {type(state).__name__}")
        source = FullFile(store, state, weights_only, read_file=lambda: read_lightning_folder(folder, weights_only))
        return restore(source, state, strict=strict, agree=agree_in_group)
    if found.kind == "folder":
        raise CheckpointLoadError(incomplete_folder(store.sharded_read().open()))
    reading = store.sharded_read()
    try:
        with reading.naming():
            if state is None:
                whole = ShardedFolder(reading, {}, weights_only)
                return read_full(whole.folder, whole.objects, whole.index, keys=list(whole.keys()), fetch=whole.fetch)
            if not isinstance(state, dict):
                raise TypeError(
                    f"Loading the sharded checkpoint {store.shown!r} needs a dict of states such as"
                    f" {{'model': model, 'optimizer': optimizer}}, got a {type(state).__name__}"
                )
            shards = ShardedFolder(reading, state, weights_only, agreed=True)
            try:
                return restore(shards, state, strict=strict, agree=agree_in_group)
            except BaseException:
                shards.undo_state_init()
                raise
    finally:
        reading.close()


def incomplete_folder(folder: Path) -> str:
    """Why ``folder`` (not a complete sharded checkpoint) cannot be loaded, naming what it lacks."""
    if not any(folder.iterdir()):
        return f"Checkpoint path {str(folder)!r} is an empty folder, not a checkpoint"
    for name in (INDEX_FILE, OBJECTS_FILE):
        kind = disk.special_kind(folder / name) if (folder / name).is_symlink() else None
        if kind is not None:
            return f"{str(folder)!r} is a sharded checkpoint folder whose {name} is {kind}; it cannot be read"
    lacking = [name for name in (INDEX_FILE, OBJECTS_FILE) if not (folder / name).is_file()]
    return (
        f"{str(folder)!r} is a folder but not a complete sharded checkpoint: it has no {' and no '.join(lacking)}"
        " (a copy that stopped early, or files deleted since); load a complete checkpoint"
    )


class ShardedFolder:
    """A folder of shards as an ``EntrySource``: checks from its index alone, reads into new storage of the
    target's layout (any number of processes), hands the values to torch's distributed state-dict API. ``agreed``:
    opened inside the load walk's first agreement, so the ranks can share the checks of the data files' digests."""

    def __init__(self, reading: ShardedRead, state: dict[str, Any], weights_only: bool | None, agreed: bool = False) -> None:
        self.path = reading.shown
        self._reading = reading
        self.fetch: Fetch | None = reading.fetch
        self._agreed = agreed
        self._state = state
        self._weights_only = weights_only
        self._opened: tuple[Path, dict[str, Any], Any] | None = None
        self._targets: dict[str, dict[str, Tensor]] = {}
        self._had_no_state: list[Optimizer] = []  # optimizers that torch's state-dict API fills while checking

    def _open(self) -> tuple[Path, dict[str, Any], Any]:
        if self._opened is None:
            folder = self._reading.open()
            objects = read_objects(folder, self._weights_only)
            check_index_crc(folder, objects.get("index_crc32"))
            index = read_index(folder)
            self._reading.check_binding(folder, index, objects, _rank_and_world_size() if self._agreed else None)
            self._opened = (folder, objects, index)
        return self._opened

    @property
    def folder(self) -> Path:
        return self._open()[0]

    @property
    def objects(self) -> dict[str, Any]:
        return self._open()[1]

    @property
    def index(self) -> Any:
        return self._open()[2]

    def keys(self) -> list[str]:
        return list(self.objects["skeleton"])

    def saved_value(self, key: str) -> Any:
        return self.objects["skeleton"][key]  # other entries stay whole in the skeleton

    def saved_kind(self, key: str) -> str:
        return self.objects["kinds"].get(key, OTHER)  # recorded when it was saved

    def check(self, present: dict[str, Any], strict: bool) -> None:
        """Check each entry against the index; remember, per module/optimizer, the tensors to read."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        skeleton, kinds, paths, index = self.objects["skeleton"], self.objects["kinds"], self.objects["tensors"], self.index
        self._had_no_state = [obj for obj in present.values() if isinstance(obj, Optimizer) and not obj.state]
        for key, obj in present.items():
            kind, saved_kind = layout.kind_of(obj), kinds.get(key, OTHER)
            fit.check_kind(key, kind, saved_kind)
            if kind == OTHER:
                fit.check_stateful_entry(key, obj, skeleton[key])
                continue
            current = collect_states(layout.DistributedStateDicts(self._state, StateDictOptions()), self._state, keys=[key])[key]
            own = {flat: path for flat, path in paths.items() if path[0] == key}
            if kind == MODULE:
                saved_shapes: dict[str, Any] = dict.fromkeys(skeleton[key])
                for flat, path in own.items():
                    saved_shapes[path[1]] = tuple(index.state_dict_metadata[flat].size)
                fit.check_module_fits(f"the model in state[{key!r}]", current, saved_shapes, strict)
            else:
                fit.check_optimizer_fits(key, skeleton[key], current)
            _, current_tensors, current_paths = layout.split_tensors({key: current}, {key: kind})
            targets = {path: current_tensors[flat] for flat, path in current_paths.items()}
            into = {flat: targets[path] for flat, path in own.items() if path in targets}
            for flat, target in into.items():
                saved = tuple(index.state_dict_metadata[flat].size)
                if saved != tuple(target.shape):
                    raise fit.CheckpointMismatchError(
                        f"state[{key!r}]: {'/'.join(map(str, own[flat][1:]))!r} has shape {saved} in the"
                        f" checkpoint but {tuple(target.shape)} here"
                    )
            self._targets[key] = into

    def undo_state_init(self) -> None:
        """Empty again the optimizers that had no state before the check (a load that did not go through):
        to see their layout, torch's ``get_optimizer_state_dict`` gave them a state (a zero-gradient step at
        learning rate 0: ``step`` 1, zero moments), which is not what their first real step would start from."""
        for optimizer in self._had_no_state:
            optimizer.state.clear()

    def read(self, present: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every entry's tensors read into new storage shaped like their targets, so a failed read changes nothing
        (but an optimizer that had no state, a resumed job's, straight into the placeholder state torch's API gave
        it: no second copy, and a failed load empties it); and the rest of the checkpoint, tensors in full."""
        skeleton, paths = self.objects["skeleton"], self.objects["tensors"]
        # a placeholder sharing memory with a parameter, a buffer or another placeholder is staged like the rest
        taken = {_storage_of(tensor) for tensor in layout.parameters_and_buffers(present.values())}
        staged = {}
        for key, into in self._targets.items():
            fresh = present[key] in self._had_no_state  # its state is torch's placeholder: read straight into it
            for flat, target in into.items():
                storage = _storage_of(target)
                staged[flat] = target if fresh and storage not in taken else torch.empty_like(target)
                taken.add(storage)
        _read_tensors(self.folder, staged, fetch=self.fetch)
        values = {
            key: layout.fill(skeleton[key], staged, paths, key) if key in self._targets else skeleton[key] for key in present
        }
        rest = [key for key in skeleton if key not in present]
        return values, read_full(self.folder, self.objects, self.index, keys=rest, fetch=self.fetch)

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, value, options=StateDictOptions(strict=strict))

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(layout.owner_of(optimizer, self._state, key), optimizer, value, options=StateDictOptions())
        layout.keep_saved_group_options(optimizer, value)


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local tensor (under ``no_grad``, the object the planner hands the reader); a tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage_of(tensor: Tensor) -> int:
    """Where a tensor's (or a DTensor's local) storage starts: tensors that share memory share it."""
    return _local(tensor).untyped_storage().data_ptr()


def _read_tensors(folder: Path, destinations: dict[str, Tensor], full: bool = False, fetch: Fetch | None = None) -> None:
    """Fill ``destinations`` (flat key -> tensor or DTensor of any layout, new storage made for this load)
    from the folder's shards (``fetch``: see ``SafeFileSystemReader``)."""
    if not destinations:
        return
    try:
        with quiet_single_process(), torch.no_grad():  # (see _local)
            staging = [_local(tensor) for tensor in destinations.values()]
            reader = SafeFileSystemReader(folder, staging=staging, fetch=fetch)
            dcp.load(destinations, storage_reader=reader, no_dist=full or not _distributed())
    except (Exception, dcp.CheckpointException) as err:  # torch's CheckpointException is a BaseException
        raise CheckpointLoadError(f"Reading the checkpoint {str(folder)!r} failed: {first_failure(err)}") from err


def read_objects(folder: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """The folder's objects file, loaded safely, after checking that it is one of ours."""
    objects_path = folder / OBJECTS_FILE
    if not objects_path.is_file():
        raise CheckpointLoadError(
            f"{str(folder)!r} is not a checkpoint folder written by fabric: it has no {OBJECTS_FILE}"
        )
    objects = safe_load(objects_path, weights_only=weights_only)
    if not isinstance(objects, dict) or objects.get("format") != FORMAT:
        raise CheckpointLoadError(f"{str(objects_path)!r} is not a fabric checkpoint objects file")
    if objects.get("version") != VERSION:
        raise CheckpointLoadError(
            f"{str(folder)!r} has checkpoint format version {objects.get('version')!r}; this fabric reads {VERSION}"
        )
    return objects


def read_full(folder: Path, objects: dict[str, Any], index: Any, keys: list[str], fetch: Fetch | None = None) -> dict[str, Any]:
    """The entries ``keys`` as ``state_dict_type="full"`` would have written them (optimizers in the numbered
    form), every tensor read whole into this process (no process group needed)."""
    skeleton, kinds, paths = objects["skeleton"], objects["kinds"], objects["tensors"]
    wanted = {flat: path for flat, path in paths.items() if path[0] in keys}
    saved = index.state_dict_metadata
    destinations = {flat: torch.empty(tuple(saved[flat].size), dtype=saved[flat].properties.dtype) for flat in wanted}
    _read_tensors(folder, destinations, full=True, fetch=fetch)
    result = {}
    for key in keys:
        value = layout.fill(skeleton[key], destinations, wanted, key) if kinds[key] != OTHER else skeleton[key]
        result[key] = layout.optimizer_numbered(value) if kinds[key] == OPTIMIZER else value
    return result


def _distributed() -> bool:
    """Whether there is a process group (else torch.distributed.checkpoint runs with ``no_dist``)."""
    return dist.is_available() and dist.is_initialized()


def _rank_and_world_size() -> tuple[int, int] | None:
    """This process's rank and the world size of the default group (the group ``restore`` agrees over), if any."""
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else None
