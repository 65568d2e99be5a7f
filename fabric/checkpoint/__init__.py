"""Checkpoints: what goes into one, where its bytes live, and how it comes back (``docs/architecture.md``).

``stateful`` is the protocol every entry follows; ``pipeline`` the save and the load a strategy runs, over
``formats/`` (what the bytes are: one object per format, chosen from one table), ``state`` (the save walk),
``restore`` (the load walk) and ``storage/`` (where they live: the disk or an object store); ``host`` and ``plugin``
declare what the wing needs of a strategy and of a CheckpointIO plugin; ``resume/`` keeps a dataloader's place;
``errors`` holds every error. The names of the modules that import torch load on first use, so that importing
``fabric.checkpoint`` imports only the standard library (``errors`` and ``stateful``, imported here, need no more).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric._core.lazy import lazy_attributes
from fabric.checkpoint import errors
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

if TYPE_CHECKING:
    from fabric.checkpoint.fit import check_optimizer_state_fits, check_state_dict_fits
    from fabric.checkpoint.per_rank import PER_RANK_KEY, gather_per_rank_states, state_of_rank
    from fabric.checkpoint.resume.random_state import capture_random_state, restore_random_state
    from fabric.checkpoint.state import collect_states

__all__ = [
    "PER_RANK_KEY",
    "SAVED_RANKS_KEY",
    "CheckedStateful",
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
__all__ += errors.__all__  # every error class, from its one home

# (any other name: a submodule, e.g. fabric.checkpoint.pipeline)
__getattr__ = lazy_attributes(
    __name__,
    {
        **dict.fromkeys(errors.__all__, errors.__name__),  # (imported already: the standard library only)
        **dict.fromkeys(("check_optimizer_state_fits", "check_state_dict_fits"), "fabric.checkpoint.fit"),
        **dict.fromkeys(("PER_RANK_KEY", "gather_per_rank_states", "state_of_rank"), "fabric.checkpoint.per_rank"),
        **dict.fromkeys(("capture_random_state", "restore_random_state"), "fabric.checkpoint.resume.random_state"),
        "collect_states": "fabric.checkpoint.state",
    },
)
