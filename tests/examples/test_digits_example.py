"""The digits examples run as a user runs them: raw PyTorch, Fabric in 1 and 2 processes, under
`fabric run`, and resumed from their checkpoint."""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch

from support import PYTHON, REPO
from support.processes import fabric_run, run

EXAMPLES = REPO / "examples" / "digits"
RAW = EXAMPLES / "raw_pytorch.py"
FABRIC = EXAMPLES / "train_fabric.py"
VAL_SIZE = 359  # 1797 // 5 images held out

missing = [name for name in ("sklearn", "matplotlib", "tqdm") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.procs, pytest.mark.skipif(bool(missing), reason=f"the examples need {missing}: pip install fabric-torch[examples]")]


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 400)
    assert data[-8:-4] == b"IEND"


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.timeout(60)
def test_raw_pytorch_example_short(tmp_path: Path) -> None:
    result = run([PYTHON, str(RAW), "--short", "--epochs", "1", "--out", str(tmp_path)], timeout=55)
    assert "Final validation accuracy" in result.stdout and "Checkpoint:" in result.stdout
    results = _results(tmp_path)
    assert results["start_epoch"] == 0 and results["val_total"] == VAL_SIZE
    _check_png(tmp_path / "loss_curve.png")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1


@pytest.mark.timeout(180)
def test_fabric_example_two_process_demo_then_resumed_in_one_process_under_fabric_run(tmp_path: Path) -> None:
    """`make demo` (2 CPU processes, fewer epochs), then its checkpoint continued in 1 process via `fabric run`."""
    demo = run([PYTHON, str(FABRIC), "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
                "--epochs", "3", "--out", str(tmp_path)], timeout=110)
    results = _results(tmp_path)
    assert results["world_size"] == 2
    # each rank validated its own half; the all_reduce'd counts cover the whole validation set
    assert results["val_total"] == VAL_SIZE
    assert results["val_acc"] > 0.9, results
    assert demo.stdout.count("Final validation accuracy") == 1  # rank 0 only
    assert demo.stdout.count("epoch 3:") == 1
    assert "Checkpoint:" in demo.stdout and "Loss curve:" in demo.stdout
    _check_png(tmp_path / "loss_curve.png")
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert set(checkpoint) == {"model", "optimizer", "epoch", "history"}
    assert checkpoint["epoch"] == 3 and len(checkpoint["history"]["val_acc"]) == 3

    resumed_run = run(fabric_run("--accelerator", "cpu", FABRIC, "--short", "--epochs", "4", "--resume",
                                 "--out", tmp_path), timeout=60)
    assert "Resuming from" in resumed_run.stdout and "after epoch 3" in resumed_run.stdout
    assert "epoch 1:" not in resumed_run.stdout and "epoch 4:" in resumed_run.stdout
    results = _results(tmp_path)
    assert results["start_epoch"] == 3 and results["world_size"] == 1 and results["val_total"] == VAL_SIZE
    assert results["val_acc"] > 0.9  # the trained weights came back (a fresh model would be near 10%)
    resumed = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert resumed["epoch"] == 4 and len(resumed["history"]["val_acc"]) == 4
    # the loss curve goes on where it stopped: the resumed run's steps come after the first run's
    before = checkpoint["history"]["train_loss"]
    assert resumed["history"]["train_loss"][: len(before)] == before and len(resumed["history"]["train_loss"]) > len(before)
    _check_png(tmp_path / "loss_curve.png")
    with open(tmp_path / "logs" / "version_1" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["epoch"] for row in rows if row["epoch"]] == ["4"] and any(row["train/loss"] for row in rows)
