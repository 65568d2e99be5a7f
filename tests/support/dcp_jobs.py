"""Real multi-process jobs of ``support/scripts/dcp/job.py`` (sharded checkpoints), started as torchrun would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from support.environment import job_environment
from support.loading import script_path

JOB = script_path("dcp", "job.py")


def job_model() -> nn.Sequential:
    """The model every ``job.py`` rank builds (before sharding it), and the tests load into plainly.

    Wide enough that each rank's shard of either weight is over 64 KiB: such items are read straight into
    the load's new storage, smaller ones (the biases) through ``torch.load`` (``safe_reader``), so both
    read paths are exercised."""
    return nn.Sequential(nn.Linear(6, 8192), nn.ReLU(), nn.Linear(8192, 4))


def start_job(world_size: int, script: Path, *args: str) -> list[subprocess.Popen]:
    """``world_size`` real rank processes of ``script`` on one gloo rendezvous."""
    env = job_environment(MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    return [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]


def finish_job(procs: list[subprocess.Popen], timeout: float = 180) -> list[str]:
    """Wait for every rank; on a failure or timeout kill them all and fail with their output."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("the job did not finish:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    failed = [(rank, out) for rank, (proc, out) in enumerate(zip(procs, outputs)) if proc.returncode != 0]
    assert not failed, "\n".join(f"rank {rank} failed:\n{out[-3000:]}" for rank, out in failed)
    return outputs


def run_job(world_size: int, *args: str, timeout: float = 180) -> list[str]:
    return finish_job(start_job(world_size, JOB, *args), timeout=timeout)
