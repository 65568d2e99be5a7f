"""A program written for Lightning Fabric, run unchanged (its import pointed at ``fabric``), saving to ``memory://``
and to ``s3://`` (moto's S3 server on 127.0.0.1): the checkpoint is in the store, nothing lands on the local disk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.environment import job_environment
from support.loading import script_path
from support.processes import run
from support.s3 import s3_objects

pytestmark = [pytest.mark.procs, pytest.mark.usefixtures("clean_fabric_env")]


def _run(url: str, devices: int, cwd: Path) -> str:
    result = run([sys.executable, str(script_path("checkpoint", "lightning_program.py")), url, str(devices)],
                 timeout=150, env=job_environment(), cwd=cwd)
    return result.stdout


@pytest.mark.timeout(180)
def test_a_lightning_program_saves_to_memory_unchanged(tmp_path: Path) -> None:
    out = _run("memory://run/ckpt.pt", 1, tmp_path)
    assert "rank 0: loaded step 3 from memory://run/ckpt.pt" in out
    assert list(tmp_path.iterdir()) == []  # no local folder named after the URL


@pytest.mark.timeout(180)
def test_a_lightning_program_saves_to_s3_unchanged_on_two_processes(s3_bucket: str, tmp_path: Path) -> None:
    url = f"{s3_bucket}/run/ckpt.pt"
    out = _run(url, 2, tmp_path)
    assert f"rank 0: loaded step 3 from {url}" in out and f"rank 1: loaded step 3 from {url}" in out
    objects = s3_objects(s3_bucket)
    assert any(name.endswith("/run/ckpt.pt") for name in objects) and any(".fabric/" in name for name in objects)
    assert list(tmp_path.iterdir()) == []
