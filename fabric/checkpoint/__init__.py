"""Checkpoint state: what goes into a checkpoint and how it comes back, in one place.

- ``stateful``: the named protocol (Stateful, with the optional "check before load", "per-rank
  state" and "every rank's state beside the entry" declarations) that every checkpoint entry follows,
  and ``ResizableStateful``, by which a user's loader takes a state saved by another number of processes;
- ``state``: the walk that turns ``Fabric.save``'s state into a checkpoint, asking the strategy what a
  module or an optimizer becomes; ``restore``: the one walk that loads a checkpoint back, in every format;
- ``per_rank``: states that differ between ranks, gathered into the file rank 0 writes;
- ``random_state`` and ``loader_progress``: the exact-resume state of a set-up dataloader;
- ``errors``: every error raised while making, checking or loading a checkpoint (standard library only).

How the bytes reach the disk is the CheckpointIO's business (``fabric.plugins.io``). The names exported here
load on first use, so that importing ``fabric.checkpoint.errors`` (as the layers below do) imports nothing
else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fabric._core.lazy import submodule

if TYPE_CHECKING:
    from fabric.checkpoint.errors import (
        CheckpointLoadError,
        CheckpointMismatchError,
        CommitRecordError,
        CorruptCheckpointError,
        UnsafeCheckpointError,
    )
    from fabric.checkpoint.fit import check_optimizer_state_fits, check_state_dict_fits
    from fabric.checkpoint.per_rank import PER_RANK_KEY, gather_per_rank_states, state_of_rank
    from fabric.checkpoint.resume.random_state import capture_random_state, restore_random_state
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

_LAZY = {
    **dict.fromkeys(
        ("CheckpointLoadError", "CheckpointMismatchError", "CommitRecordError", "CorruptCheckpointError", "UnsafeCheckpointError"),
        "fabric.checkpoint.errors",
    ),
    **dict.fromkeys(("check_optimizer_state_fits", "check_state_dict_fits"), "fabric.checkpoint.fit"),
    **dict.fromkeys(("PER_RANK_KEY", "gather_per_rank_states", "state_of_rank"), "fabric.checkpoint.per_rank"),
    **dict.fromkeys(("capture_random_state", "restore_random_state"), "fabric.checkpoint.resume.random_state"),
    "collect_states": "fabric.checkpoint.state",
    **dict.fromkeys(
        (
            "SAVED_RANKS_KEY",
            "CheckedStateful",
            "PerRankStateful",
            "ResizableStateful",
            "SavedRanksStateful",
            "Stateful",
            "checks_state",
            "has_per_rank_state",
            "is_resizable",
            "is_stateful",
            "keeps_saved_ranks",
        ),
        "fabric.checkpoint.stateful",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    return submodule(__name__, name)  # a submodule, e.g. fabric.checkpoint.pipeline


__all__ = [
    "PER_RANK_KEY",
    "SAVED_RANKS_KEY",
    "CheckedStateful",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CommitRecordError",
    "CorruptCheckpointError",
    "PerRankStateful",
    "ResizableStateful",
    "SavedRanksStateful",
    "Stateful",
    "UnsafeCheckpointError",
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
