"""Loaders of a user's with a state of their own, for the resize tests.

Each rank takes every ``world_size``-th sample of what is left of the epoch's order (as a
``DistributedSampler`` splits an epoch), and the state is that order and the number of batches this rank
has handed out of its share: one rank's state is not another's, so on another number of processes rank 0's
state alone would replay or skip samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader


class ShardPositionLoader(DataLoader):
    """Keeps its place in this rank's share of the epoch; has no way to continue on another number of processes."""

    def __init__(self, samples: Tensor, batch_size: int, rank: int, world_size: int, seed: int = 0) -> None:
        super().__init__(samples, batch_size=batch_size)
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.rest: list[int] = torch.randperm(len(samples), generator=generator).tolist()  # the epoch's order still to use
        self.share_of = (rank, world_size)
        self.position = 0  # batches of this rank's share handed out (the one in hand included)
        self.loaded: list[Any] = []  # every state load_state_dict was given

    def _share(self) -> list[int]:
        rank, world_size = self.share_of
        return self.rest[rank::world_size]

    def __iter__(self) -> Iterator[Any]:
        share, size = self._share(), self.batch_size
        assert size is not None
        while self.position * size < len(share):
            start = self.position * size
            self.position += 1
            yield self.dataset[share[start : start + size]]  # type: ignore[index]

    def __len__(self) -> int:
        assert self.batch_size is not None
        return math.ceil(len(self._share()) / self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"rest": list(self.rest), "position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict)
        self.rest, self.position = list(state_dict["rest"]), int(state_dict["position"])


class ResizableShardLoader(ShardPositionLoader):
    """The same, and it continues on another number of processes (``fabric.checkpoint.ResizableStateful``):
    the samples every saving rank used are taken out of the order, and the rest is split afresh."""

    def resized_state_dict(self, states: list[dict[str, Any]], world_size: int, rank: int) -> dict[str, Any]:
        saved, size = len(states), self.batch_size
        assert size is not None
        used = {sample for r, state in enumerate(states) for sample in state["rest"][r::saved][: state["position"] * size]}
        rest = [sample for sample in states[0]["rest"] if sample not in used]
        if len(rest) % world_size:
            raise ValueError(f"{len(rest)} samples are left, which {world_size} processes cannot share evenly")
        return {"rest": rest, "position": 0}
