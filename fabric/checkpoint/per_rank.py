"""States that differ between ranks (``PerRankStateful``) in a file that rank 0 alone writes.

Saving gathers each such object's state from every rank into ``{"per_rank": [rank 0's, rank 1's, ...]}``;
loading hands the object that record, and :func:`state_of_rank` picks this rank's entry.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fabric.checkpoint.stateful import has_per_rank_state
from fabric.utilities.exceptions import CheckpointMismatchError

__all__ = ["PER_RANK_KEY", "gather_per_rank_states", "is_per_rank_record", "state_of_rank"]

#: The key of a checkpoint entry that holds one state per rank.
PER_RANK_KEY = "per_rank"


def is_per_rank_record(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {PER_RANK_KEY} and isinstance(value[PER_RANK_KEY], list)


def gather_per_rank_states(
    state: dict[str, Any], all_gather: Callable[[Tensor], Tensor], world_size: int
) -> dict[str, Any]:
    """Replace each ``PerRankStateful`` object of ``state`` by ``{"per_rank": [its state on every rank]}``.

    A collective: every rank must call it with the same keys (``Fabric.save`` is called on every rank).
    """
    keys = [key for key, value in state.items() if has_per_rank_state(value)]
    if not keys:
        return state
    local = {key: state[key].state_dict() for key in keys}
    everyone = _gather_objects(local, all_gather, world_size)
    gathered = dict(state)
    for key in keys:
        gathered[key] = {PER_RANK_KEY: [states[key] for states in everyone]}
    return gathered


def state_of_rank(value: Any, rank: int, world_size: int, what: str) -> Any:
    """This rank's entry of a per-rank record (a plain state is returned as it is)."""
    if not is_per_rank_record(value):
        return value
    states = value[PER_RANK_KEY]
    if len(states) != world_size:
        raise CheckpointMismatchError(
            f"The saved state of the {what} comes from a run with {len(states)} process(es), this run has"
            f" {world_size}: an exact resume needs the same number of processes. Leave the {what} out of"
            " the state you load to resume without its position and random states."
        )
    return states[rank]


def _gather_objects(obj: Any, all_gather: Callable[[Tensor], Tensor], world_size: int) -> list[Any]:
    """``obj`` from every rank, in rank order, through tensor collectives (works for any strategy)."""
    if world_size == 1:
        return [obj]
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = all_gather(torch.tensor([payload.numel()], dtype=torch.int64)).reshape(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    rows = all_gather(padded).reshape(world_size, -1).cpu()
    return [
        torch.load(io.BytesIO(rows[rank, :size].numpy().tobytes()), weights_only=True)
        for rank, size in enumerate(sizes)
    ]
