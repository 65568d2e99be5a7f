"""Top-level functions for in-process MultiprocessingLauncher tests (spawn imports them)."""

from __future__ import annotations

import os
import time

import torch


def return_structures(scale: float) -> dict:
    return {
        "value": 42,
        "rank": int(os.environ["RANK"]),
        "setup_idx": os.environ.get("WORKER_SETUP_IDX"),
        "master_port": os.environ.get("MASTER_PORT"),
        "tensor": torch.arange(4.0) * scale,
        "nested": {"ones": torch.ones(2, 2), "items": [torch.zeros(3, dtype=torch.int64), "text"]},
    }


def return_tensor() -> torch.Tensor:
    return torch.full((3,), float(os.environ["RANK"]) + 7.0)


def fail_on_rank(rank_to_fail: int) -> None:
    if int(os.environ["RANK"]) == rank_to_fail:
        raise ValueError(f"boom from rank {rank_to_fail}")
    time.sleep(60)  # a peer stuck waiting for the failed rank


def world_size_of(fabric: object) -> int:
    """For ``Fabric.launch``: what every rank's Fabric says the world size is."""
    return int(fabric.world_size)  # type: ignore[attr-defined]
