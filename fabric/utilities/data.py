"""Sharding a user's DataLoader across ranks without asking them to build a DistributedSampler."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

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

class _SamplerIndices(Dataset):
    """The indices one pass of a user's sampler yields, seen as a dataset so it can be sharded."""

    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler
        self._indices: list[Any] | None = None

    def refresh(self) -> None:
        self._indices = list(self._sampler)

    def __getitem__(self, position: int) -> Any:
        if self._indices is None:
            self.refresh()
        assert self._indices is not None
        return self._indices[position]

    def __len__(self) -> int:
        return len(self._sampler)  # type: ignore[arg-type]


class DistributedSamplerWrapper(DistributedSampler):
    """Shards whatever a user's own sampler yields (weighted, custom order, ...) across ranks.

    Each epoch, the user's sampler is drawn once (the same way on every rank when it is seeded), and
    every rank takes its own disjoint share of that draw.
    """

    def __init__(self, sampler: Sampler, **kwargs: Any) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(f"{type(sampler).__name__} has no len(); a sampler must have one to be sharded")
        kwargs.setdefault("shuffle", False)
        super().__init__(_SamplerIndices(sampler), **kwargs)

    def __iter__(self) -> Iterator[Any]:
        indices: _SamplerIndices = self.dataset  # type: ignore[assignment]
        indices.refresh()
        return (indices[position] for position in super().__iter__())


def distributed_sampler_for(sampler: Sampler | None, num_replicas: int, rank: int) -> DistributedSampler:
    """The distributed replacement of a loader's sampler, seeded alike on every rank."""
    seed = int(os.environ.get("FABRIC_GLOBAL_SEED", 0))
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        return DistributedSampler(
            sampler.data_source, num_replicas=num_replicas, rank=rank, shuffle=isinstance(sampler, RandomSampler), seed=seed  # type: ignore[arg-type]
        )
    if isinstance(sampler, DistributedSampler):
        return sampler
    return DistributedSamplerWrapper(sampler, num_replicas=num_replicas, rank=rank, seed=seed)  # type: ignore[arg-type]


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
