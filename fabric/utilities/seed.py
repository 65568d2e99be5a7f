"""Seeding every random number generator a training loop touches, and passing the seed to children."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

_SEED_VARIABLE = "FABRIC_GLOBAL_SEED"
_WORKERS_VARIABLE = "FABRIC_SEED_WORKERS"
_MAX_SEED = np.iinfo(np.uint32).max
_MIN_SEED = np.iinfo(np.uint32).min


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed python's ``random``, NumPy and torch (all devices) with ``seed`` and return it.

    Without a seed, the value of ``FABRIC_GLOBAL_SEED`` is used, else 0. The seed is written to that
    variable so processes started later (launched ranks, dataloader workers) can pick it up.
    With ``workers=True`` each dataloader worker gets its own derived seed (see ``worker_init_function``).
    """
    if seed is None:
        env_seed = os.environ.get(_SEED_VARIABLE)
        if env_seed is None:
            seed = 0
            rank_zero_warn(f"No seed given; seeding with {seed}.")
        else:
            try:
                seed = int(env_seed)
            except ValueError as err:
                raise ValueError(f"{_SEED_VARIABLE}={env_seed!r} is not an integer seed") from err
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed_everything(seed=...) takes an int, got {seed!r}")
    if not _MIN_SEED <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed} is out of range; accepted: {_MIN_SEED} to {_MAX_SEED}")
    if verbose:
        rank_zero_info(f"Seed set to {seed}")
    os.environ[_SEED_VARIABLE] = str(seed)
    os.environ[_WORKERS_VARIABLE] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA/MPS generators too
    return seed


def reset_seed() -> None:
    """Seed again from ``FABRIC_GLOBAL_SEED`` (used in freshly started processes)."""
    seed = os.environ.get(_SEED_VARIABLE)
    if seed is None:
        return
    seed_everything(int(seed), workers=bool(int(os.environ.get(_WORKERS_VARIABLE, "0"))), verbose=False)


def worker_init_function(worker_id: int, rank: int | None = None) -> None:
    """Give every dataloader worker of every rank a distinct, reproducible seed."""
    global_rank = rank if rank is not None else int(os.environ.get("RANK", 0))
    process_seed = torch.initial_seed()
    base_seed = process_seed - worker_id
    seed_sequence = np.random.SeedSequence([base_seed, worker_id, global_rank])
    np.random.seed(seed_sequence.generate_state(4))
    torch_seed, random_seed = seed_sequence.spawn(2)
    torch.manual_seed(int(torch_seed.generate_state(1, dtype=np.uint64)[0]))
    random.seed(int(random_seed.generate_state(1, dtype=np.uint64)[0]))
