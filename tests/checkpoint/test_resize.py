"""Resuming mid-epoch on another number of processes (DDP and FSDP): every sample of the epoch is used
once (plus the padding a DistributedSampler adds), the run continues from the saved step, and the same
resize of the same checkpoint gives the same parameters bit for bit. Real processes, each job with a
timeout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from fabric.checkpoint.resize import epoch_order, rank_share
from support.environment import job_environment
from support.loading import script_path

JOB = script_path("resize", "job.py")
SAMPLES, BATCH, STEPS = 50, 3, 2


def run(out: Path, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(JOB), str(out), *args], env=job_environment(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def reports(out: Path, tag: str, processes: int) -> list[dict]:
    return [json.loads((out / f"{tag}-rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("strategy", "saved_on", "resumed_on"),
    [("ddp", 4, 2), ("ddp", 2, 3), ("ddp", 2, 1), ("fsdp", 4, 2), ("fsdp", 2, 3)],
)
def test_a_resized_run_uses_every_sample_once_and_is_reproducible(tmp_path, strategy, saved_on, resumed_on):
    run(tmp_path, "save", strategy, str(saved_on), str(STEPS))
    for tag in ("a", "b"):
        run(tmp_path, "resume", strategy, str(resumed_on), tag)
    first = [sample for report in reports(tmp_path, "save", saved_on) for sample in report["used"]]
    assert len(first) == STEPS * BATCH * saved_on
    resumed = reports(tmp_path, "a", resumed_on)
    assert all(report["resumed_at"] == STEPS for report in resumed)
    rest = [sample for report in resumed for sample in report["used"]]
    counts = Counter(first + rest)
    assert set(counts) == set(range(SAMPLES)), "samples skipped"
    left = SAMPLES - len(first)
    padding = math.ceil(left / resumed_on) * resumed_on - left  # as DistributedSampler pads an epoch
    assert sum(counts.values()) == SAMPLES + padding and max(counts.values()) <= 2, counts
    again = reports(tmp_path, "b", resumed_on)
    assert [r["used"] for r in again] == [r["used"] for r in resumed]
    a, b = torch.load(tmp_path / "a-params.pt"), torch.load(tmp_path / "b-params.pt")
    assert all(torch.equal(a[name], b[name]) for name in a), "the same resize twice gave other parameters"


def test_the_rest_of_an_epoch_is_split_as_the_sampler_splits_a_whole_one():
    record = {"length": 10, "shuffle": True, "seed": 3, "drop_last": False, "num_replicas": 2}
    order = epoch_order(record, epoch=1)
    generator = torch.Generator()
    generator.manual_seed(3 + 1)
    assert order == torch.randperm(10, generator=generator).tolist()  # DistributedSampler's draw
    shares = [rank_share(order[4:], 4, rank, drop_last=False) for rank in range(4)]
    assert [len(share) for share in shares] == [2, 2, 2, 2]
    assert Counter(sample for share in shares for sample in share) == Counter(order[4:] + order[4:6])  # 6 left, 2 repeated
    assert [rank_share(order[4:], 4, rank, drop_last=True) for rank in range(4)] == [[order[4 + r]] for r in range(4)]
