"""DataLoader helpers: sharding a user's loader across ranks, and the data helpers Lightning users import.

``suggested_max_num_workers``, ``AttributeDict``, ``has_len`` and ``has_iterable_dataset`` have the names
and behaviour of ``lightning.fabric.utilities.data``.
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from fabric.utilities.distributed import DistributedSamplerWrapper
from fabric.utilities.rank_zero import rank_zero_warn

# DataLoader arguments that can be read back from an instance and passed to a new one
_LOADER_ATTRIBUTES = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)



def loader_arguments(dataloader: DataLoader) -> dict[str, Any]:
    """The arguments (besides dataset and sampling) that re-create a DataLoader like ``dataloader``."""
    kwargs = {name: getattr(dataloader, name) for name in _LOADER_ATTRIBUTES if hasattr(dataloader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)  # only valid with worker processes
        kwargs["persistent_workers"] = False
    return kwargs

def distributed_sampler_for(sampler: Any, num_replicas: int, rank: int) -> DistributedSampler:
    """The distributed replacement of a loader's sampler, seeded alike on every rank."""
    from fabric.utilities.seed import global_seed_from_environment

    seed = global_seed_from_environment() or 0
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        return DistributedSampler(
            sampler.data_source, num_replicas=num_replicas, rank=rank, shuffle=isinstance(sampler, RandomSampler), seed=seed  # type: ignore[arg-type]
        )
    if isinstance(sampler, DistributedSampler):
        return sampler
    # the user's sampler decides the order (weights, curriculum, ...): each rank takes its share, unshuffled
    return DistributedSamplerWrapper(sampler, num_replicas=num_replicas, rank=rank, seed=seed, shuffle=False)


def shard_dataloader(dataloader: DataLoader, num_replicas: int, rank: int) -> DataLoader:
    """A DataLoader like ``dataloader`` whose sampler yields only this rank's share of the data."""
    if isinstance(dataloader.dataset, IterableDataset):
        return dataloader  # an iterable dataset shards itself (it knows the rank from the environment)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise TypeError(
            f"The DataLoader uses a custom batch sampler ({type(batch_sampler).__name__}) that Fabric cannot shard;"
            " call setup_dataloaders(..., use_distributed_sampler=False) and shard it yourself"
        )
    sampler = distributed_sampler_for(dataloader.sampler, num_replicas, rank)
    kwargs = loader_arguments(dataloader)
    if batch_sampler is None:
        kwargs.update(batch_size=None, sampler=sampler)
    else:
        kwargs.update(batch_size=batch_sampler.batch_size, drop_last=batch_sampler.drop_last, sampler=sampler)
    try:
        return type(dataloader)(dataloader.dataset, **kwargs)
    except TypeError as err:
        raise TypeError(
            f"Fabric could not re-create your {type(dataloader).__name__} with a distributed sampler ({err})."
            " Call setup_dataloaders(..., use_distributed_sampler=False) and pass a DistributedSampler yourself"
        ) from err


def has_iterable_dataset(dataloader: Any) -> bool:
    """Whether ``dataloader`` reads from an ``IterableDataset``."""
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def sized_len(dataloader: Any) -> int | None:
    """``len(dataloader)``, or None when it has no length."""
    try:
        return len(dataloader)
    except (TypeError, NotImplementedError):
        return None


def has_len(dataloader: Any) -> bool:
    """Whether ``len(dataloader)`` works; warns when it is 0, or when an iterable dataset claims a length."""
    length = sized_len(dataloader)
    if length is None:
        return False
    if length == 0:
        rank_zero_warn(f"`{type(dataloader).__name__}` has length 0; check that this is what you meant.")
    if has_iterable_dataset(dataloader):
        rank_zero_warn(
            "Your `IterableDataset` defines `__len__`. With several dataloader workers the length is only right"
            " if each worker yields its own part of the data, not a copy of all of it."
        )
    return True


def suggested_max_num_workers(local_world_size: int) -> int:
    """How many dataloader workers each of ``local_world_size`` processes on this machine should use at most.

    The CPUs this process may run on, shared by the local processes, less one per process for the
    process itself; at least 1.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r} must be >= 1")
    return max(1, _available_cpus() // local_world_size - 1)


def _available_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return len(affinity(0))
    return os.cpu_count() or 1


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr`` is ``hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as missing:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from missing

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError as missing:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from missing

    def __repr__(self) -> str:
        """One ``"key": value`` line per key, sorted, the values aligned."""
        if not self:
            return ""
        width = max(len(str(key)) for key in self) + 3
        lines = []
        for key in sorted(self):
            label = f'"{key}":'
            lines.append(f"{label:{width}s} {self[key]}")
        return "\n".join(lines)
