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

from fabric.checkpoint.agreement import agree_in_group, broadcast_in_group, gather_in_group, on_rank_zero, rank_in_group
from fabric.checkpoint.async_save import (
    SaveHandle,
    background_group,
    finished,
    start_background_save,
    wait_for_pending_save,
)
from fabric.checkpoint.errors import CheckpointLoadError, CheckpointMismatchError, CorruptCheckpointError
from fabric.checkpoint.fit import check_kind, check_module_fits, check_optimizer_fits, check_stateful_entry
from fabric.checkpoint.formats.file import safe_load
from fabric.checkpoint.formats.format import Load, Save
from fabric.checkpoint.formats.shard_reader import (
    INDEX_FILE,
    OBJECTS_FILE,
    SafeFileSystemReader,
    check_data_files_belong,
    check_files_listed,
    check_index_crc,
    data_files_written,
    first_failure,
    own_error,
    quiet_single_process,
    read_error,
    read_index,
)
from fabric.checkpoint.integrity import crc32
from fabric.checkpoint.layout import (
    MODULE,
    OPTIMIZER,
    OTHER,
    DistributedStateDicts,
    fill,
    keep_saved_group_options,
    kind_of,
    merge_parts,
    module_in_state,
    optimizer_numbered,
    optimizer_part,
    parameters_and_buffers,
    plain_copy,
    split_tensors,
    whole_model_keys,
)
from fabric.checkpoint.restore import restore
from fabric.checkpoint.state import collect_states
from fabric.checkpoint.storage import Fetch, Found, ShardedRead, ShardedSave, Store, locate
from fabric.checkpoint.storage.disk import out_of_space

FORMAT = "fabric-sharded-checkpoint"
VERSION = 1


class Sharded:
    """The "sharded" format as the formats' table holds it: a folder holding DCP's index and our objects file."""

    name = "sharded"

    def claims(self, found: Found) -> bool:
        return found.kind == "folder" and {INDEX_FILE, OBJECTS_FILE} <= found.files

    def save(self, save: Save) -> None:
        save.refuse_storage_options()
        save_sharded(save.store, save.state, filter=save.filter, async_save=save.async_save)

    def load(self, load: Load) -> Any:
        """Into objects of any layout, whatever the strategy (the host is not asked); without a state, the whole
        checkpoint with every tensor read in full."""
        state, weights_only = load.state, load.weights_only
        check_dict_of_states(load.store, state)
        reading = load.store.sharded_read()
        try:
            with reading.naming():
                if state is None:
                    whole = ShardedFolder(reading, {}, weights_only)
                    return read_full(whole.folder, whole.objects, whole.index, keys=list(whole.keys()), fetch=whole.fetch)
                assert isinstance(state, dict)  # (check_dict_of_states)
                shards = ShardedFolder(reading, state, weights_only, agreed=True)
                try:
                    return restore(shards, state, strict=load.strict, agree=agree_in_group)
                except BaseException:
                    shards.undo_state_init()
                    raise
        finally:
            reading.close()


SHARDED = Sharded()


def check_dict_of_states(store: Store, state: Any) -> None:
    """A folder's checkpoint loads into a dict of states (or, read whole, without any): never one object (``load_raw``)."""
    if state is not None and not isinstance(state, dict):
        raise CheckpointMismatchError(
            f"{store.shown!r} is a sharded checkpoint folder: load it into a dict of states such as {{'model': model,"
            f" 'optimizer': optimizer}} with fabric.load(path, state), rather than load_raw() into a {type(state).__name__}"
        )


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
    entries = collect_states(DistributedStateDicts(state, StateDictOptions()), state, filter)
    kinds = {key: kind_of(obj) for key, obj in state.items()}
    skeleton, tensors, paths = split_tensors(entries, kinds)
    if any(whole_model_keys(obj) is not None for obj in state.values() if isinstance(obj, Module)):
        # each rank holds its part of the model (pipeline stages): rank 0's record of the save is every rank's
        parts = gather_in_group((skeleton, paths))
        if parts is not None:
            skeleton, paths = merge_parts(parts, kinds)
    objects = {"format": FORMAT, "version": VERSION, "kinds": kinds, "skeleton": skeleton, "tensors": paths}
    # rank 0 cleans up after crashed saves and names this save; every rank gets the name
    ticket = on_rank_zero(
        partial(store.prepare_sharded_save, _files_written()), rank=rank_in_group(), broadcast=broadcast_in_group
    )
    if async_save:
        staged = {flat: plain_copy(tensor) for flat, tensor in tensors.items()}
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
    """Every rank writes its shards and digests its data files; rank 0 gathers each rank's part (or error), writes the
    objects file (what binds the save's files to it) and commits; all learn the outcome."""
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
            full = out_of_space(save.folder, nbytes)
            if full is not None:
                part["error"] = f"{full}{save.room_hint}; {part['error']}"
        else:
            part = _part(save, writer, rank)
        parts = gather_in_group(part, group)

        def commit() -> None:
            assert parts is not None
            first = next((part for part in parts if "error" in part), None)
            if first is not None:
                raise _PART_ERRORS[first["raises"]](f"{failed} {first['error']}")
            try:
                binding = _binding(save.folder, ticket, parts)
                save.commit(parts, OBJECTS_FILE, lambda file: torch.save({**objects, **binding}, file))
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


def _part(save: ShardedSave, writer: Any, rank: int) -> dict[str, Any]:
    """This rank's part of the commit: what the store made of its files, and each of its data files' size and records
    digest (``data_files``, read from the copy this rank wrote), or the error it met."""
    part = save.part(writer, rank)
    if "error" in part:
        return part
    try:
        return {**part, "data_files": data_files_written(save.folder, writer.written)}
    except Exception as err:
        return {"error": f"reading back rank {rank}'s data files failed: {type(err).__name__}: {err}", "raises": "RuntimeError"}


def _binding(folder: Path, save_id: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: what the objects file (whose records carry CRCs) records to bind every file to this save: the CRC of the
    index (a plain pickle with none of its own), the save's id, and each data file's name, size and records digest."""
    data_files = {name: entry for part in parts for name, entry in part["data_files"].items()}
    return {"index_crc32": crc32((folder / INDEX_FILE).read_bytes()), "save_id": save_id, "data_files": data_files}


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


class ShardedFolder:
    """A folder of shards as an ``EntrySource``: checks from its index alone, reads into new storage of the
    target's layout (any number of processes), hands the values to torch's distributed state-dict API. ``agreed``:
    opened inside the load walk's first agreement, so the ranks can share the checks of the data files' digests."""

    def __init__(self, reading: ShardedRead, state: dict[str, Any], weights_only: bool | None, agreed: bool = False) -> None:
        self.path = reading.shown
        self._reading = reading
        self.fetch: Fetch | None = reading.fetch  # (a store's: with the checks of a file fetched whole, once opened)
        self._agreed = agreed
        self._state = state
        self._weights_only = weights_only
        self._opened: tuple[Path, dict[str, Any], Any] | None = None
        self._targets: dict[str, dict[str, Tensor]] = {}
        self._had_no_state: list[Optimizer] = []  # optimizers that torch's state-dict API fills while checking
        self._parts: dict[str, dict[str, Any]] = {}  # optimizers of a part of a model: their part of the saved state

    def _open(self) -> tuple[Path, dict[str, Any], Any]:
        if self._opened is None:
            folder = self._reading.open((INDEX_FILE, OBJECTS_FILE))
            objects = read_objects(folder, self._weights_only)
            check_index_crc(folder, objects.get("index_crc32"))
            index = read_index(folder)
            self._check_binding(folder, index, objects)
            self._opened = (folder, objects, index)
        return self._opened

    def _check_binding(self, folder: Path, index: Any, objects: dict[str, Any]) -> None:
        """The index, the objects file and the data files are of one save, before anything is read: on a local folder
        from the files' sizes and records digests (each rank every world-size-th file's, when the ranks agree
        afterwards); on a store from its commit record's sizes, and each file fetched whole as on a local folder."""
        save_id, recorded = objects.get("save_id"), objects.get("data_files")  # (recorded: checked before it is used)
        on_store = self._reading.recorded()
        if on_store is None:
            check_data_files_belong(folder, index, save_id, recorded, _rank_and_world_size() if self._agreed else None)
            return
        generation, sizes = on_store
        if save_id != generation:
            raise CorruptCheckpointError(
                f"Checkpoint {self.path!r} mixes objects of different saves: its {OBJECTS_FILE!r} was written by save"
                f" {save_id}, its commit record names generation {generation}"
            )
        check_files_listed(self.path, recorded, index, f"the save that wrote {OBJECTS_FILE!r} (save {save_id})")
        assert isinstance(recorded, dict)  # (what check_files_listed made sure of)
        for name, entry in sorted(recorded.items()):
            if sizes.get(name) != entry.get("bytes"):
                said = "does not list it" if name not in sizes else f"says {sizes[name]} bytes"
                raise CorruptCheckpointError(
                    f"Checkpoint {self.path!r} mixes objects of different saves: {OBJECTS_FILE!r} records the data file"
                    f" {name!r} with {entry.get('bytes')} bytes, the commit record {said}"
                )
        spans: dict[str, list[tuple[int, int]]] = {}
        for info in (index.storage_data or {}).values():
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        self._reading.expect_items(spans)
        fetch = self._reading.fetch
        assert fetch is not None, "a store's sharded read fetches what it reads"

        def fetch_and_check(needed: dict[str, list[tuple[int, int, str]]]) -> set[str]:
            whole = fetch(needed)  # a file fetched whole is checked as a local folder's file is
            for name in sorted(whole):
                check_data_files_belong(folder, index, save_id, recorded, only={name})
            return whole

        self.fetch = fetch_and_check

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
            kind, saved_kind = kind_of(obj), kinds.get(key, OTHER)
            check_kind(key, kind, saved_kind)
            if kind == OTHER:
                check_stateful_entry(key, obj, skeleton[key])
                continue
            hooks = DistributedStateDicts(self._state, StateDictOptions(), error=CheckpointMismatchError)
            current = collect_states(hooks, self._state, keys=[key])[key]
            own = {flat: path for flat, path in paths.items() if path[0] == key}
            if kind == MODULE:
                saved_shapes: dict[str, Any] = dict.fromkeys(skeleton[key])
                for flat, path in own.items():
                    saved_shapes[path[1]] = tuple(index.state_dict_metadata[flat].size)
                what, whole = f"the model in state[{key!r}]", whole_model_keys(obj)
                if whole is not None:  # a part of a model (pipeline stages): its keys are the whole model's
                    check_module_fits(what, dict.fromkeys(sorted(whole)), saved_shapes, strict)
                    saved_shapes = {name: shape for name, shape in saved_shapes.items() if name in current}
                check_module_fits(what, current, saved_shapes, strict)
            else:
                saved = skeleton[key]
                if whole_model_keys(module_in_state(obj, self._state, key, CheckpointMismatchError)) is not None:
                    saved = self._parts[key] = optimizer_part(saved, current)
                check_optimizer_fits(key, saved, current)
            _, current_tensors, current_paths = split_tensors({key: current}, {key: kind})
            targets = {path: current_tensors[flat] for flat, path in current_paths.items()}
            into = {flat: targets[path] for flat, path in own.items() if path in targets}
            for flat, target in into.items():
                saved = tuple(index.state_dict_metadata[flat].size)
                if saved != tuple(target.shape):
                    raise CheckpointMismatchError(
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
        taken = {_storage_of(tensor) for tensor in parameters_and_buffers(present.values())}
        staged = {}
        for key, into in self._targets.items():
            fresh = present[key] in self._had_no_state  # its state is torch's placeholder: read straight into it
            for flat, target in into.items():
                storage = _storage_of(target)
                staged[flat] = target if fresh and storage not in taken else torch.empty_like(target)
                taken.add(storage)
        _read_tensors(self.folder, staged, fetch=self.fetch)
        values = {
            key: fill(skeleton[key], staged, paths, key) if key in self._targets else skeleton[key] for key in present
        }
        rest = [key for key in skeleton if key not in present]
        return values, read_full(self.folder, self.objects, self.index, keys=rest, fetch=self.fetch)

    def load_module(self, key: str, module: Module, value: Any, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, value, options=StateDictOptions(strict=strict))

    def load_optimizer(self, key: str, optimizer: Optimizer, value: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        module = module_in_state(optimizer, self._state, key, CheckpointMismatchError)
        if key in self._parts:
            value = optimizer_part(value, self._parts[key])
        set_optimizer_state_dict(module, optimizer, value, options=StateDictOptions())
        keep_saved_group_options(optimizer, value)


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
        raise read_error(folder, err) from err


def read_objects(folder: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """The folder's objects file, loaded safely, after checking that it is one of ours."""
    objects_path = folder / OBJECTS_FILE
    if not objects_path.is_file():
        raise CorruptCheckpointError(f"{str(folder)!r} is not a checkpoint folder written by fabric: it has no {OBJECTS_FILE}")
    objects = safe_load(objects_path, weights_only=weights_only)
    if not isinstance(objects, dict) or objects.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{str(objects_path)!r} is not a fabric checkpoint objects file")
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
        value = fill(skeleton[key], destinations, wanted, key) if kinds[key] != OTHER else skeleton[key]
        result[key] = optimizer_numbered(value) if kinds[key] == OPTIMIZER else value
    return result


def _distributed() -> bool:
    """Whether there is a process group (else torch.distributed.checkpoint runs with ``no_dist``)."""
    return dist.is_available() and dist.is_initialized()


def _rank_and_world_size() -> tuple[int, int] | None:
    """This process's rank and the world size of the default group (the group ``restore`` agrees over), if any."""
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else None
