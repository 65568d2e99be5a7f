"""The Ray Train recipe (docs/ray.md): a worker SIGKILLed mid-epoch, Ray restarts the job, and it resumes exactly.

Runs ``examples/ray/train_ray.py`` twice (2 CPU workers under ``TorchTrainer``): never interrupted, and with
worker 1 killed at a step under ``FailureConfig(max_failures=1)``. Every loss of the restarted attempt (both
ranks) equals the uninterrupted run's at the same step, bit for bit, and so do the final weights. Needs the
``ray`` extra (``make test-ray``); skipped without it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from support import REPO
from support.environment import clean_env

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed: `make test-ray` installs the `ray` extra")

pytestmark = [pytest.mark.procs, pytest.mark.cold]

EXAMPLE = REPO / "examples" / "ray" / "train_ray.py"
SHORT = ["--epochs", "2", "--samples", "256", "--batch-size", "16", "--save-every", "4"]  # 8 steps an epoch, 16 in all
STEPS = 16
FAIL_AT = 11  # mid-epoch 2; the restart resumes from step 8 (or 4, if Ray had not taken in step 8's report yet)


def ray_processes(ray_dir: Path) -> list[int]:
    """Processes of the Ray cluster the example started: they all inherit its RAY_TMPDIR (ours alone)."""
    marker = f"RAY_TMPDIR={ray_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def run_example(out: Path, ray_dir: Path, *extra: str) -> list[dict]:
    env = clean_env(OMP_NUM_THREADS="1", RAY_TMPDIR=str(ray_dir), CUDA_VISIBLE_DEVICES="")
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--out", str(out), *SHORT, *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"the example ran longer than 240 s:\n{output[-6000:]}")
    assert process.returncode == 0, f"exit code {process.returncode}:\n{output[-6000:]}"
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def attempts(records: list[dict]) -> list[list[dict]]:
    """The records split where the step count starts again (a restarted attempt)."""
    split: list[list[dict]] = []
    for record in records:
        if not split or record["step"] != split[-1][-1]["step"] + 1:
            split.append([])
        split[-1].append(record)
    return split


@pytest.mark.timeout(600)
def test_worker_killed_mid_epoch_resumes_bit_exactly(tmp_path):
    ray_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        reference = run_example(tmp_path / "reference", ray_dir)
        killed = run_example(tmp_path / "killed", ray_dir, "--fail-at", str(FAIL_AT))
    finally:
        left = ray_processes(ray_dir)
        for pid in left:  # only the cluster the example started (our RAY_TMPDIR); ray.shutdown() should have ended it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert not left, f"Ray processes still running after ray.shutdown(): {left}"

    assert [record["step"] for record in reference] == list(range(1, STEPS + 1))
    expected = {record["step"]: record["losses"] for record in reference}

    assert (tmp_path / "killed" / "killed").exists(), "worker 1 was never killed"
    first, second = attempts(killed)  # exactly one restart
    assert [record["step"] for record in first] == list(range(1, FAIL_AT))
    resumed_from = second[0]["resumed_from"]
    assert resumed_from in (4, 8), f"resumed from step {resumed_from}: not from a checkpoint reported before the kill"
    assert [record["step"] for record in second] == list(range(resumed_from + 1, STEPS + 1))
    assert all(record["resumed_from"] == resumed_from for record in second)
    for record in first + second:
        # both ranks' losses, as float.hex: equal strings are equal floats, bit for bit
        assert record["losses"] == expected[record["step"]], f"step {record['step']} (resumed from {resumed_from})"
    assert len(second) * 2 >= 16  # replayed losses compared: 8 steps x 2 ranks at least

    final = torch.load(tmp_path / "killed" / "final.pt")
    final_reference = torch.load(tmp_path / "reference" / "final.pt")
    assert final.keys() == final_reference.keys()
    for name, tensor in final_reference.items():
        assert torch.equal(final[name], tensor), name
