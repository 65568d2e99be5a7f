"""Seeding every random number generator a training loop touches, and passing the seed to children.

The seed travels in environment variables under two names, ours (``FABRIC_GLOBAL_SEED``,
``FABRIC_SEED_WORKERS``) and Lightning's (``PL_GLOBAL_SEED``, ``PL_SEED_WORKERS``): both are written and
both are read, so job scripts written for Lightning Fabric keep their seeds.
"""

from __future__ import annotations

import logging
import os
import random
from functools import partial
from typing import Any

import numpy as np
import torch

from fabric.utilities.rank_zero import rank_prefixed_message, rank_zero_warn

log = logging.getLogger(__name__)

SEED_VARIABLES = ("FABRIC_GLOBAL_SEED", "PL_GLOBAL_SEED")  # ours first: it wins when both are set
WORKERS_VARIABLES = ("FABRIC_SEED_WORKERS", "PL_SEED_WORKERS")
# whether seed_everything ran in this process (a forked child inherits it, a spawned or re-run one does not)
_seeded_here = False
_MAX_SEED = np.iinfo(np.uint32).max
_MIN_SEED = np.iinfo(np.uint32).min


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed python's ``random``, NumPy and torch (all devices) with ``seed`` and return it.

    Without a seed, the value of ``FABRIC_GLOBAL_SEED`` (or Lightning's ``PL_GLOBAL_SEED``) is used,
    else 0. The seed is written to both variables so processes started later (launched ranks,
    dataloader workers) pick it up. With ``workers=True``, loaders set up afterwards give each worker
    its own derived seed (``worker_init_function``). ``verbose=False`` logs and warns nothing.
    """
    if seed is None:
        seed = global_seed_from_environment()
        if seed is None:
            seed = 0
            if verbose:
                rank_zero_warn(f"No seed given; seeding with {seed}.")
    seed = _as_seed(seed)
    if not _MIN_SEED <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed} is out of range; accepted: {_MIN_SEED} to {_MAX_SEED}")
    if verbose:
        # every rank logs, prefixed with its rank where one is known (as Lightning Fabric does)
        log.info(rank_prefixed_message(f"Seed set to {seed}", _rank_or_none()))
    for name in SEED_VARIABLES:
        os.environ[name] = str(seed)
    for name in WORKERS_VARIABLES:
        os.environ[name] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA/MPS generators too
    global _seeded_here
    _seeded_here = True
    return seed


def global_seed_from_environment() -> int | None:
    """The seed a parent process (or a job script) left in the environment, or None."""
    for name in SEED_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError as err:
                raise ValueError(f"{name}={value!r} is not an integer seed") from err
    return None


def seed_workers_from_environment() -> bool:
    """Whether the last ``seed_everything`` (here or in a parent process) asked for seeded workers."""
    return any(os.environ.get(name, "0") == "1" for name in WORKERS_VARIABLES)


def reset_seed() -> None:
    """Seed a process that starts unseeded (a spawned worker) from the seed its parent left in the environment.

    A process that has seeded keeps its generators where they are: reseeding it would replay the draws
    made since (a model's initial weights would come back as its first dropout masks). Nothing happens
    when no seed was set.
    """
    if _seeded_here:
        return
    seed = global_seed_from_environment()
    if seed is None:
        return
    seed_everything(seed, workers=seed_workers_from_environment(), verbose=False)


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


pl_worker_init_function = worker_init_function  # Lightning's name for the same job


def _as_seed(seed: object) -> int:
    """An int seed from an int (or NumPy int) or a string of digits; floats and bools are refused."""
    if isinstance(seed, str) and seed.strip().lstrip("-").isdigit():
        return int(seed)
    if isinstance(seed, (bool, float)) or not hasattr(seed, "__index__"):
        raise TypeError(f"seed_everything(seed=...) takes an int, got {seed!r} ({type(seed).__name__})")
    return int(seed.__index__())


def _rank_or_none() -> int | None:
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def add_worker_seeding(dataloader: Any, rank: int) -> None:
    """Give ``dataloader`` the seeding ``worker_init_fn`` after ``seed_everything(workers=True)``.

    A loader with its own ``worker_init_fn`` keeps it.
    """
    if not seed_workers_from_environment():
        return
    if getattr(dataloader, "worker_init_fn", _ABSENT) is None:
        dataloader.worker_init_fn = partial(worker_init_function, rank=rank)


_ABSENT = object()
