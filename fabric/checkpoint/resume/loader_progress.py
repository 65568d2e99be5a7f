"""Where a set-up dataloader is in the data, kept so that a run stopped mid-epoch resumes exactly.

A resumed run matches the uninterrupted one only if, at the first step after the checkpoint, every
rank sees the same batch and the same random numbers. :class:`LoaderProgress` records per rank the
data position (epoch, batches consumed), the random generator states, and, because re-creating a
DataLoader iterator itself draws from torch's generator (the workers' base seed, a RandomSampler's
seed), the generator state from the start of the interrupted epoch (see ``docs/resume.md``).
A resumed epoch skips the consumed batches at the batch-sampler level (:class:`SkipBatches`), so no
consumed sample is loaded again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.per_rank import PER_RANK_KEY, is_per_rank_record, state_of_rank
from fabric.checkpoint.resume.random_state import capture_random_state, check_random_state, restore_random_state
from fabric.checkpoint.resume.resize import derived_seed, epoch_order, order_record, rank_share, seed_everything_derived
from fabric.checkpoint.stateful import is_resizable
from fabric.utilities.data import loader_arguments
from fabric.utilities.seed import global_seed_from_environment

__all__ = ["LoaderOwnState", "LoaderProgress", "SkipBatches", "loader_skipping"]

_STATE_KEYS = ("epoch", "batches_consumed", "epoch_start", "random_state", "generators")


class LoaderProgress:
    """The position of one rank in ``dataloader`` and what it takes to continue from there."""

    def __init__(self, dataloader: Any, rank: int = 0, world_size: int = 1) -> None:
        self._dataloader = dataloader
        self._rank = rank
        self._world_size = world_size
        self._num_iter_calls = 0  # the epoch the next iteration runs
        self._epoch: int | None = None  # the epoch being iterated, None between epochs
        self._consumed = 0  # batches handed out in that epoch
        self._epoch_start: dict[str, Any] | None = None  # generator states from just before its iterator
        self._start = 0  # samples of the epoch's order consumed before this iteration began (after a resize)
        self._resume: dict[str, Any] | None = None  # a loaded position, taken up by the next iteration

    def iterate(self) -> Iterator[Any]:
        """One epoch of the loader (after a load: the rest of the saved epoch), counting the batches."""
        resume, self._resume = self._resume, None
        epoch = self._num_iter_calls if resume is None else resume["epoch"]
        self._num_iter_calls = epoch + 1
        _set_sampler_epoch(self._dataloader, epoch)
        self._epoch = epoch
        self._start = 0
        if resume is not None and "share" in resume:  # another layout of ranks: this rank's share of the rest
            self._consumed, self._start = 0, resume["start"]
            self._epoch_start = _generator_states(self._dataloader)
            iterator = iter(_loader_over(self._dataloader, resume["share"]))
        elif resume is not None and resume["batches_consumed"] > 0:
            self._consumed = resume["batches_consumed"]
            self._epoch_start = resume["epoch_start"]
            iterator = _resumed_iterator(self._dataloader, self._consumed, self._epoch_start)
        else:
            self._consumed = 0
            self._epoch_start = _generator_states(self._dataloader)
            iterator = iter(self._dataloader)
        for batch in iterator:
            self._consumed += 1
            yield batch
        self._epoch = None

    def position(self) -> tuple[int, int]:
        """``(epoch, batches consumed)``: where the next batch comes from (in this layout of ranks)."""
        position = self._position()
        return position["epoch"], position["batches_consumed"]

    def _position(self) -> dict[str, Any]:
        if self._epoch is not None:  # inside an epoch (saved after a step, as a loop does)
            return {"epoch": self._epoch, "batches_consumed": self._consumed, "epoch_start": self._epoch_start, "start": self._start}
        if self._resume is not None and "share" in self._resume:  # loaded after a resize, not iterated yet
            return {"epoch": self._resume["epoch"], "batches_consumed": 0, "epoch_start": None, "start": self._resume["start"]}
        if self._resume is not None:  # loaded, not iterated yet: the loaded position still holds
            return dict(self._resume)
        return {"epoch": self._num_iter_calls, "batches_consumed": 0, "epoch_start": None, "start": 0}

    def continue_at(self, epoch: int, batches_consumed: int) -> None:
        """Make the next iteration begin at ``(epoch, batches consumed)`` (a position learnt from a peer, not a file)."""
        self._resume = {"epoch": epoch, "batches_consumed": batches_consumed, "epoch_start": _generator_states(self._dataloader)}
        self._epoch = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the data and random generator states."""
        return {
            **self._position(),
            "random_state": capture_random_state(),
            "generators": [generator.get_state() for generator in _loader_generators(self._dataloader)],
            "order": _order_of(self._dataloader),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the random generators now; the next iteration resumes at the saved position."""
        state = self.check_state_dict(state_dict)
        if "share" in state:  # resumed by another number of processes: derived random state (resize.py)
            seed_everything_derived(state["seed"], _loader_generators(self._dataloader))
            self._resume = {key: state[key] for key in ("epoch", "start", "share")}
            self._epoch = None
            return
        restore_random_state(state["random_state"])
        for generator, saved in zip(_loader_generators(self._dataloader), state["generators"]):
            generator.set_state(saved)
        self._resume = {key: state[key] for key in ("epoch", "batches_consumed", "epoch_start")}
        self._epoch = None

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """This rank's entry of ``state_dict`` (one state or every rank's); ValueError if it does not fit.

        A position saved by another number of processes, or inside an epoch that was itself resumed that
        way, becomes this rank's share of the rest of the epoch (``resize``).
        """
        if is_per_rank_record(state_dict):
            states = state_dict[PER_RANK_KEY]
            if len(states) != self._world_size or any(isinstance(s, dict) and s.get("start", 0) for s in states):
                return self._share_of_rest(states)
        state = state_of_rank(state_dict, self._rank, self._world_size, "dataloader")
        _check_loader_state(state, self._dataloader)
        return state

    def _share_of_rest(self, states: list[Any]) -> dict[str, Any]:
        """This rank's share of the rest of the saved epoch, and its derived seed (see ``resize``)."""
        for state in states:
            _check_loader_state(state, self._dataloader, generators=False)
        saved, here = len(states), self._world_size
        record, first = states[0].get("order"), states[0]
        if record is None or any(state.get("order") != record for state in states):
            raise CheckpointMismatchError(
                f"The dataloader's position was saved by {saved} process(es) and this run has {here}: resuming on"
                " another number of processes needs the position of a loader that setup_dataloaders gave a"
                " DistributedSampler (saved by this version or later). Leave the dataloader out of the state you"
                " load to start the epoch afresh"
            )
        length = len(self._dataloader.dataset)
        if record["length"] != length:
            raise CheckpointMismatchError(f"The dataloader's position is in a dataset of {record['length']} samples; this one has {length}")
        consumed = {(state["epoch"], state["batches_consumed"]) for state in states}
        if len(consumed) != 1:
            raise CheckpointMismatchError(f"The saved ranks stand at different places of the data (epoch, batches): {sorted(consumed)}")
        epoch, batches = consumed.pop()
        order = epoch_order(record, epoch)
        start = int(first.get("start", 0))
        position = min(len(order), start + batches * record["batch_size"] * saved)
        base = global_seed_from_environment()
        return {
            "epoch": epoch,
            "start": position,
            "share": rank_share(order[position:], here, self._rank, record["drop_last"]),
            "seed": derived_seed(record["seed"] if base is None else base, epoch, position, self._rank),
        }


class LoaderOwnState:
    """A loader that keeps its own state: the checkpoint holds its ``state_dict()`` as Lightning Fabric writes it,
    so checkpoints move between the two. Such a state may be one rank's place in its shard, so every rank's is kept
    beside the entry (``SavedRanksStateful``) for the loader's ``resized_state_dict`` on another number of processes."""

    def __init__(self, dataloader: Any, rank: int = 0, world_size: int = 1) -> None:
        self._dataloader = dataloader
        self._rank = rank
        self._world_size = world_size
        self._num_iter_calls = 0

    def iterate(self) -> Iterator[Any]:
        _set_sampler_epoch(self._dataloader, self._num_iter_calls)
        self._num_iter_calls += 1
        return iter(self._dataloader)

    def state_dict(self) -> dict[str, Any]:
        return self._dataloader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._dataloader.load_state_dict(self.check_state_dict(state_dict))

    def check_state_dict(self, state_dict: Any) -> Any:
        """``state_dict`` itself; ValueError if it is our own position record (saved from a plain loader)."""
        if is_per_rank_record(state_dict) or (isinstance(state_dict, dict) and set(_STATE_KEYS) <= set(state_dict)):
            raise ValueError(
                f"the saved state is fabric's position in a plain DataLoader, but this loader"
                f" ({type(self._dataloader).__name__}) keeps a state of its own; load a checkpoint saved from this kind of loader"
            )
        return state_dict

    def state_from_saved_ranks(self, entry: Any, states: list[Any]) -> Any:
        """The state this rank loads: ``entry`` on the number of processes that saved it (as Lightning Fabric
        loads it); on another, what the loader's ``resized_state_dict`` makes of every saving rank's state."""
        saved, here = len(states), self._world_size
        if saved == here:
            return entry
        name = type(self._dataloader).__name__
        if not is_resizable(self._dataloader):
            raise CheckpointMismatchError(
                f"the loader's state was saved by {saved} process(es) and this run has {here}, but {name} cannot take"
                " a state saved by another number of processes (its state may be one rank's place in the data)."
                f" Give {name} a method resized_state_dict(states, world_size, rank) that makes this rank's state from"
                " every saving rank's (fabric.checkpoint.ResizableStateful), or leave the loader out of the state you"
                " load to start the epoch afresh"
            )
        return self._dataloader.resized_state_dict(list(states), here, self._rank)


# ---- skipping consumed batches without loading them ------------------------------------------------


class SkipBatches:
    """A batch sampler that leaves out the first ``skip`` batches of ``batch_sampler``, drawing only their indices
    (no sample is loaded). ``on_start`` runs once they are drawn (the sampler's random draws for the epoch are done
    by then), before the first kept batch, or at the end if nothing is left."""

    def __init__(self, batch_sampler: Any, skip: int, on_start: Callable[[], None] | None = None) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip
        self.on_start = on_start

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batch_sampler)
        started = False
        try:
            for _ in range(self.skip):
                if next(iterator, _END) is _END:
                    break
            started = True
            if self.on_start is not None:
                self.on_start()
            yield from iterator
        finally:
            if not started and self.on_start is not None:
                self.on_start()

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


_END = object()


def loader_skipping(dataloader: Any, skip: int, on_start: Callable[[], None]) -> Any | None:
    """A DataLoader like ``dataloader`` whose next epoch starts after ``skip`` batches; None when it cannot be rebuilt
    that way (not a DataLoader, an iterable dataset, a subclass without the standard arguments): skip by iterating."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    kwargs = loader_arguments(dataloader)
    if dataloader.batch_sampler is not None:
        kwargs["batch_sampler"] = SkipBatches(dataloader.batch_sampler, skip, on_start)
    else:  # batch_size=None: the sampler yields one sample's index per "batch"
        kwargs.update(batch_size=None, sampler=SkipBatches(dataloader.sampler, skip, on_start))
    try:
        return type(dataloader)(dataloader.dataset, **kwargs)
    except (TypeError, ValueError):
        return None


# ---- the loader's random draws ------------------------------------------------------------------------


def _loader_generators(dataloader: Any) -> list[torch.Generator]:
    """The torch generators a loader draws from itself (its own, its sampler's), each once."""
    candidates = (
        getattr(dataloader, "generator", None),
        getattr(getattr(dataloader, "sampler", None), "generator", None),
        getattr(getattr(getattr(dataloader, "batch_sampler", None), "sampler", None), "generator", None),
    )
    found: list[torch.Generator] = []
    for generator in candidates:
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu" and all(g is not generator for g in found):
            found.append(generator)
    return found


def _generator_states(dataloader: Any) -> dict[str, Any]:
    """What a new iterator of ``dataloader`` draws from: torch's global generator and the loader's own."""
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in _loader_generators(dataloader)]}


def _resumed_iterator(dataloader: Any, skip: int, epoch_start: dict[str, Any]) -> Iterator[Any]:
    """The rest of an epoch after ``skip`` batches, with the random draws of the interrupted run.

    Making a DataLoader iterator draws from torch's global generator (the workers' base seed, a
    RandomSampler's seed), which in the interrupted run happened when the epoch began. So the
    generators are set back to that moment for the iterator's own draws, and torch's is set forward
    again (to its loaded state) just before the first remaining batch is fetched.
    """
    now = torch.get_rng_state()
    torch.set_rng_state(epoch_start["torch"])
    for generator, saved in zip(_loader_generators(dataloader), epoch_start["generators"]):
        generator.set_state(saved)
    restored = False

    def continue_random_state() -> None:
        nonlocal restored
        if not restored:
            restored = True
            torch.set_rng_state(now)

    skipping = loader_skipping(dataloader, skip, continue_random_state)
    if skipping is not None:
        yield from skipping
        return
    # not a rebuildable DataLoader (an iterable dataset, a custom loader): skip by iterating
    iterator = iter(dataloader)
    try:
        for _ in range(skip):
            next(iterator)
    except StopIteration:
        return
    finally:
        continue_random_state()
    yield from iterator


def _order_of(dataloader: Any) -> dict[str, Any] | None:
    """What fixes the epoch's order of ``dataloader`` (``resize.order_record``) and its batching, or None."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is None or not isinstance(getattr(batch_sampler, "batch_size", None), int):
        return None
    record = order_record(getattr(batch_sampler, "sampler", None))
    if record is None:
        return None
    return {**record, "batch_size": batch_sampler.batch_size, "batch_drop_last": bool(batch_sampler.drop_last)}


def _loader_over(dataloader: Any, indices: list[int]) -> Any:
    """A DataLoader like ``dataloader`` that yields the samples ``indices``, in that order, batched alike."""
    from torch.utils.data import DataLoader

    batch_sampler = dataloader.batch_sampler
    kwargs = loader_arguments(dataloader)
    kwargs.update(batch_size=batch_sampler.batch_size, drop_last=batch_sampler.drop_last, sampler=indices)
    return DataLoader(dataloader.dataset, **kwargs)


def _check_loader_state(state: Any, dataloader: Any, generators: bool = True) -> None:
    if not isinstance(state, dict) or not set(_STATE_KEYS) <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            "Expected a FabricDataLoader state with 'epoch', 'batches_consumed', 'epoch_start', 'random_state'"
            f" and 'generators', got {keys}"
        )
    for key in ("epoch", "batches_consumed"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"The saved dataloader state has {key}={value!r}; expected an int >= 0")
    epoch_start = state["epoch_start"]
    if state["batches_consumed"] > 0 and not (
        isinstance(epoch_start, dict) and isinstance(epoch_start.get("torch"), torch.Tensor)
        and isinstance(epoch_start.get("generators"), list)
    ):
        raise ValueError("The saved dataloader state is mid-epoch but has no valid 'epoch_start' generator states")
    check_random_state(state["random_state"])
    if not generators:
        return
    expected = len(_loader_generators(dataloader))
    if len(state["generators"]) != expected:
        raise ValueError(
            f"The saved dataloader state has {len(state['generators'])} generator state(s) but this loader draws"
            f" from {expected}; was it saved from a loader built the same way?"
        )


def _set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Reshuffle distributed shards every epoch without the user calling ``set_epoch``."""
    samplers = (getattr(dataloader, "sampler", None), getattr(getattr(dataloader, "batch_sampler", None), "sampler", None))
    for sampler in {id(sampler): sampler for sampler in samplers}.values():  # a batch sampler usually wraps the sampler: once
        if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
