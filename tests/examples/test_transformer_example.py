"""The transformer example runs as a user runs it: 2 processes with FSDP (started by the popen launcher),
then its folder of shards resumed under tensor parallelism."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from fabric.checkpoint.formats import load_sharded
from support import PYTHON, REPO
from support.processes import run

EXAMPLE = REPO / "examples" / "transformer" / "train_fabric.py"

missing = [name for name in ("matplotlib", "tqdm") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.procs, pytest.mark.skipif(bool(missing), reason=f"the example needs {missing}: pip install fabric-torch[examples]")]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[-8:-4] == b"IEND", f"{path} is not a whole PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.timeout(300)
def test_fsdp_run_then_resumed_with_tensor_parallel(tmp_path: Path) -> None:
    first = run([PYTHON, str(EXAMPLE), "--devices", "2", "--strategy", "fsdp", "--short", "--epochs", "2",
                 "--out", str(tmp_path)], timeout=140)  # fmt: skip
    assert first.stdout.count("Final validation loss") == 1 and "(fsdp)" in first.stdout  # rank 0 prints
    assert first.stdout.count("epoch 2:") == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2 and results["start_epoch"] == 0
    assert _png_size(tmp_path / "loss_curve.png") == (1000, 400)
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "fabric-objects.pt"]
    other = load_sharded(folder)  # in this one process, no process group: the whole checkpoint
    assert other["epoch"] == 2 and len(other["history"]["val_loss"]) == 2
    first_losses = other["history"]["train_loss"]

    resumed = run([PYTHON, str(EXAMPLE), "--devices", "2", "--strategy", "tp", "--short", "--epochs", "3", "--resume",
                   "--out", str(tmp_path)], timeout=140)  # fmt: skip
    assert "Resuming from" in resumed.stdout and "after epoch 2" in resumed.stdout
    assert "epoch 1:" not in resumed.stdout and "epoch 3:" in resumed.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["start_epoch"] == 2 and results["strategy"] == "tp"
    other = load_sharded(folder)
    assert other["epoch"] == 3 and other["history"]["train_loss"][: len(first_losses)] == first_losses
    # the trained weights came back: the loss goes on from where it was, not from a fresh model's ~4.6
    assert other["history"]["train_loss"][len(first_losses)] < first_losses[0] - 0.5, other["history"]["train_loss"]
