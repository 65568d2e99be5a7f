"""Checkpoint state: what goes into a checkpoint and how it comes back, in one place.

- ``stateful``: the named protocol (Stateful, with the optional "check before load", "per-rank
  state" and "every rank's state beside the entry" declarations) that every checkpoint entry follows,
  and ``ResizableStateful``, by which a user's loader takes a state saved by another number of processes;
- ``state``: the walk that turns ``Fabric.save``'s state into a checkpoint, asking the strategy what a
  module or an optimizer becomes; ``restore``: the one walk that loads a checkpoint back, in every format;
- ``per_rank``: states that differ between ranks, gathered into the file rank 0 writes;
- ``random_state`` and ``loader_progress``: the exact-resume state of a set-up dataloader.

How the bytes reach the disk is the CheckpointIO's business (``fabric.plugins.io``).
"""

from __future__ import annotations

from fabric.checkpoint.fit import CheckpointMismatchError, check_optimizer_state_fits, check_state_dict_fits
from fabric.checkpoint.per_rank import PER_RANK_KEY, gather_per_rank_states, state_of_rank
from fabric.checkpoint.random_state import capture_random_state, restore_random_state
from fabric.checkpoint.state import collect_states
from fabric.checkpoint.stateful import (
    SAVED_RANKS_KEY,
    CheckedStateful,
    PerRankStateful,
    ResizableStateful,
    SavedRanksStateful,
    Stateful,
    checks_state,
    has_per_rank_state,
    is_resizable,
    is_stateful,
    keeps_saved_ranks,
)

__all__ = [
    "PER_RANK_KEY",
    "SAVED_RANKS_KEY",
    "CheckedStateful",
    "CheckpointMismatchError",
    "PerRankStateful",
    "ResizableStateful",
    "SavedRanksStateful",
    "Stateful",
    "capture_random_state",
    "check_optimizer_state_fits",
    "check_state_dict_fits",
    "checks_state",
    "collect_states",
    "gather_per_rank_states",
    "has_per_rank_state",
    "is_resizable",
    "is_stateful",
    "keeps_saved_ranks",
    "restore_random_state",
    "state_of_rank",
]
