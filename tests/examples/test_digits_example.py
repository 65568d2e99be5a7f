"""The digits examples run as a user runs them: raw PyTorch, Fabric in 1 and 2 processes, under
`fabric run`, and resumed from their checkpoint."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import struct
import subprocess
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
    assert set(checkpoint) == {"model", "optimizer", "loader", "epoch", "history"}
    assert checkpoint["epoch"] == 3 and len(checkpoint["history"]["val_acc"]) == 3

    # (the whole training set: the loader's saved position is in it)
    resumed_run = run(fabric_run("--accelerator", "cpu", FABRIC, "--epochs", "4", "--resume", "--out", tmp_path), timeout=60)
    assert "Resuming from" in resumed_run.stdout and "after epoch 3 of 4" in resumed_run.stdout
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


def make_demo(args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """``make demo ARGS='...'`` as a user types it, with this interpreter (its environment is the one under test: no
    install step, ``DEMO_STAMP`` is a file that is there)."""
    return run(["make", "--no-print-directory", "demo", f"PYTHON={PYTHON}", "DEMO_STAMP=Makefile", f"ARGS={args}"],
               timeout=timeout, check=False)


def named_paths(stdout: str) -> list[Path]:
    """Every path the demo's closing lines name (a line saying there is none names none)."""
    named = [line.split(":", 1)[1].split("  (")[0].strip() for line in stdout.splitlines()
             if line.startswith(("Loss curve:", "Checkpoint:", "CSV logs:"))]
    return [Path(text) for text in named if not text.startswith("none ")]


@pytest.mark.timeout(240)
def test_make_demo_says_before_it_replaces_a_checkpoint_and_resumes_with_make_demo_args(tmp_path: Path) -> None:
    """`make demo` run again says that it starts over and how to continue instead; `make demo ARGS=--resume` resumes;
    a resume after the last epoch trains nothing and names no folder it did not make."""
    short = f"--short --epochs 2 --out {tmp_path}"
    first = make_demo(short)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Starting over" not in first.stdout
    assert "To train on: add --resume --epochs 6 to the command; with make: make demo ARGS='--resume --epochs 6'" in first.stdout

    again = make_demo(short)
    assert again.returncode == 0, again.stdout + again.stderr
    said = [line for line in again.stdout.splitlines() if line.startswith("Starting over")]
    assert said == [
        f"Starting over: {tmp_path / 'checkpoint.pt'} holds an earlier run, which this run's first epoch replaces."
        " To continue that run instead: add --resume to the command; with make: make demo ARGS=--resume"
    ], again.stdout  # once (rank 0), before the first epoch's line
    assert again.stdout.index("Starting over") < again.stdout.index("epoch 1:")
    before = torch.load(tmp_path / "checkpoint.pt", weights_only=True)

    finished = make_demo(f"--resume {short}")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "has finished its 2 epochs: nothing to train. To train on: add --resume --epochs 6" in finished.stdout
    assert "epoch 1:" not in finished.stdout and "CSV logs:    none from this run" in finished.stdout
    assert all(path.exists() for path in named_paths(finished.stdout)), finished.stdout
    assert sorted(os.listdir(tmp_path / "logs")) == ["version_0", "version_1"]  # the resume made no empty version folder

    longer = make_demo(f"--resume --short --epochs 3 --out {tmp_path}")
    assert longer.returncode == 0, longer.stdout + longer.stderr
    assert f"Resuming from {tmp_path / 'checkpoint.pt'} after epoch 2 of 3" in longer.stdout
    assert "epoch 2:" not in longer.stdout and longer.stdout.count("epoch 3:") == 1
    assert all(path.exists() for path in named_paths(longer.stdout)) and len(named_paths(longer.stdout)) == 3, longer.stdout
    resumed = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    steps = len(before["history"]["train_loss"])
    assert resumed["epoch"] == 3 and resumed["history"]["train_loss"][:steps] == before["history"]["train_loss"]
    assert len(resumed["history"]["train_loss"]) > steps


@pytest.mark.timeout(60)
def test_resume_without_a_checkpoint_says_so_once_and_starts_nothing(tmp_path: Path) -> None:
    result = make_demo(f"--resume --out {tmp_path / 'empty'}", timeout=55)
    assert result.returncode != 0
    said = f"--resume: there is no checkpoint at {tmp_path / 'empty' / 'checkpoint.pt'} (without --resume a new run starts and writes one)"
    assert result.stderr.count(said) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "empty").exists()
