"""States that differ between ranks in a file that rank 0 alone writes: each ``PerRankStateful`` object's state from
every rank, as ``{"per_rank": [rank 0's, rank 1's, ...]}``, and every rank's state of the ``SavedRanksStateful`` ones
beside the entries (``SAVED_RANKS_KEY``), so that a load by another number of processes can still hand such an
object what each saving rank had.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fabric.checkpoint.errors import CheckpointMismatchError
from fabric.checkpoint.state import StateFilter, filtered
from fabric.checkpoint.stateful import SAVED_RANKS_KEY, has_per_rank_state, keeps_saved_ranks

__all__ = ["PER_RANK_KEY", "gather_per_rank_states", "is_per_rank_record", "state_of_rank"]

#: The key of a checkpoint entry that holds one state per rank.
PER_RANK_KEY = "per_rank"


def is_per_rank_record(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {PER_RANK_KEY} and isinstance(value[PER_RANK_KEY], list)


def gather_per_rank_states(
    state: dict[str, Any], all_gather: Callable[[Tensor], Tensor], world_size: int, filter: StateFilter | None = None
) -> dict[str, Any]:
    """Replace each ``PerRankStateful`` object of ``state`` by ``{"per_rank": [its state on every rank]}``, and
    each ``SavedRanksStateful`` one by its own state, with every rank's kept under ``SAVED_RANKS_KEY``
    (``filter`` applied to those as to the entries). A collective: every rank calls it with the same keys."""
    per_rank = [key for key, value in state.items() if has_per_rank_state(value)]
    beside = [key for key, value in state.items() if keeps_saved_ranks(value)]
    if not per_rank and not beside:
        return state
    if beside and SAVED_RANKS_KEY in state:
        raise ValueError(f"state[{SAVED_RANKS_KEY!r}]: the name is the checkpoint's own record of the saving processes; use another key")
    local = {key: state[key].state_dict() for key in per_rank + beside}
    everyone = _gather_objects(local, all_gather, world_size)
    gathered = dict(state)
    gathered.update({key: {PER_RANK_KEY: [states[key] for states in everyone]} for key in per_rank})
    gathered.update({key: local[key] for key in beside})
    if beside:
        kept = {key: [filtered(key, states[key], filter) for states in everyone] for key in beside}
        gathered[SAVED_RANKS_KEY] = {"world_size": world_size, "states": kept}
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
    """``obj`` from every rank, in rank order, through tensor collectives (works for any strategy). Unpickled in
    full: the bytes come from this job's own ranks, and a user's loader state may hold types that ``weights_only``
    refuses (a save must not fail where it did not before)."""
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
        torch.load(io.BytesIO(rows[rank, :size].numpy().tobytes()), weights_only=False)
        for rank, size in enumerate(sizes)
    ]
