"""Resuming mid-epoch on another number of processes (docs/resume.md, "Resuming on another number of processes").

An epoch's order does not depend on the number of processes, and ranks step in lockstep, so what a job has consumed
is a prefix of that order: one global position says where the epoch stands, and the rest of it can be split over any
number of ranks as the sampler splits an epoch. The random state after a resize is derived, not loaded, so the same
resize of the same checkpoint gives the same run, bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import numpy as np
import torch

__all__ = ["derived_seed", "epoch_order", "order_record", "rank_share", "seed_everything_derived"]


def order_record(sampler: Any) -> dict[str, Any] | None:
    """What fixes an epoch's order for ``sampler``, kept in the loader's state; None if it is not a plain
    ``DistributedSampler`` (a user's sampler, wrapped, decides its own order: no resize)."""
    from torch.utils.data import DistributedSampler

    if type(sampler) is not DistributedSampler:  # fabric's DistributedSamplerWrapper (a subclass) included
        return None
    return {
        "length": len(sampler.dataset),  # type: ignore[arg-type]
        "shuffle": bool(sampler.shuffle),
        "seed": int(sampler.seed),
        "drop_last": bool(sampler.drop_last),
        "num_replicas": int(sampler.num_replicas),
    }


def epoch_order(record: dict[str, Any], epoch: int) -> list[int]:
    """The epoch's sample order, as every ``DistributedSampler`` of the job draws it (any number of replicas)."""
    if record["shuffle"]:
        generator = torch.Generator()
        generator.manual_seed(record["seed"] + epoch)
        return torch.randperm(record["length"], generator=generator).tolist()
    return list(range(record["length"]))


def rank_share(indices: list[int], world_size: int, rank: int, drop_last: bool) -> list[int]:
    """``indices`` split over ``world_size`` ranks as ``DistributedSampler`` splits an epoch: padded by repeating
    its first entries to a multiple of ``world_size`` (or cut to one), then every ``world_size``-th from ``rank``."""
    count = len(indices)
    per_rank = count // world_size if drop_last and count % world_size else math.ceil(count / world_size)
    total = per_rank * world_size
    if total > count and count:
        repeats = math.ceil((total - count) / count)
        indices = indices + (indices * repeats)[: total - count]
    return indices[:total][rank::world_size]


def derived_seed(base: int, epoch: int, position: int, rank: int) -> int:
    """A seed for ``rank`` after a resize, fixed by the job's seed, the epoch and the global position."""
    digest = hashlib.sha256(f"fabric-resize:{base}:{epoch}:{position}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # fits torch.manual_seed's int64


def seed_everything_derived(seed: int, generators: list[torch.Generator]) -> None:
    """Seed torch, NumPy, ``random`` and the loader's own generators with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    for offset, generator in enumerate(generators, start=1):
        generator.manual_seed((seed + offset) % 2**63)
