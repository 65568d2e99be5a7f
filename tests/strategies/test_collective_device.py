"""Every tensor fabric hands to a collective is on the strategy's root device (NCCL serves nothing else).

gloo takes a tensor on any device, so these tests run under the device guard (``support/device_guard.py``,
on for the whole suite by ``conftest.py``), which refuses what NCCL would refuse. A GPU job's model is
made in host memory while the rank's device is its GPU; on the CPU the same split is played by a
module made on torch's lazy device while the root device is the CPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric.utilities.collective_device import _buckets, broadcast_tensors, on_collective_device
from support.device_guard import DEVICE_VARIABLE, LOG_VARIABLE, served_devices
from support.environment import job_environment
from support.loading import script_path
from support.processes import run

JOB = script_path("collective_device", "job.py")


def _job(mode: str, tmp_path: Path, **env: str) -> dict[int, dict]:
    environment = job_environment(**env)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={environment['MASTER_PORT']}",
        str(JOB), mode, str(tmp_path),
    ]  # fmt: skip
    run(command, timeout=180, env=environment, cwd=tmp_path)
    return {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)}


def test_the_suite_runs_under_the_guard():
    """conftest turns the guard on here and, through PYTHONPATH, in every process a test starts."""
    assert os.environ[DEVICE_VARIABLE] == "cpu"
    assert getattr(torch.distributed.broadcast, "_device_guarded", False)
    assert getattr(torch.distributed.distributed_c10d.all_gather_into_tensor, "_device_guarded", False)


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_the_guard_refuses_a_tensor_off_the_group_device(tmp_path):
    results = _job("guard", tmp_path)
    for rank in range(2):
        assert results[rank]["refused"] is not None
        assert "CollectiveDeviceError" in results[rank]["refused"] and "lazy:0" in results[rank]["refused"]
        assert "serves cpu only" in results[rank]["refused"]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_set_up_broadcast_sends_rank_zeros_weights_through_the_root_device(tmp_path):
    """A module made off the root device gets rank 0's values and stays where it was made."""
    results = _job("broadcast", tmp_path)
    assert results[0]["devices"] == results[1]["devices"] == ["lazy:0"]
    assert results[0]["tensors"] == results[1]["tensors"]
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    assert results[1]["tensors"]["0.weight"] == reference[0].weight.reshape(-1).tolist()


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_collectives_move_their_inputs_to_the_root_device(tmp_path):
    results = _job("collectives", tmp_path)
    for rank in range(2):
        assert results[rank]["all_reduce"] == [3.0]
        assert results[rank]["all_gather"] == [1.0, 2.0]
        assert results[rank]["fabric_all_reduce"] == [1.5]
        assert results[rank]["broadcast"] == [20.0]
        assert results[rank]["decision"] is True
        # on a GPU the result's tensors are moved to each rank's device; the walk must take a frozen dataclass
        assert results[rank]["frozen"] == ["Frozen", "1", [1.0, 1.0]]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_fsdp_set_up_sends_rank_zeros_weights_in_a_few_broadcasts(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    results = _job("fsdp", tmp_path, **{LOG_VARIABLE: str(log)})
    assert results[0]["tensors"] == results[1]["tensors"]
    for rank in range(2):
        # the model holds 9 tensors of two dtypes (float weights, BatchNorm's int64 step count): one broadcast each
        assert results[rank]["tensor_count"] == 9
        assert results[rank]["broadcasts"] == 2


def test_packing_keeps_dtypes_apart_and_buckets_bounded():
    tensors = [torch.zeros(10), torch.zeros(3, dtype=torch.int64), torch.zeros(30), torch.zeros(100), torch.zeros(5)]
    buckets = _buckets({torch.float32: [tensors[0], tensors[2], tensors[3], tensors[4]], torch.int64: [tensors[1]]}, 160)
    assert [[t.numel() for t in bucket] for bucket in buckets] == [[10, 30], [100], [5], [3]]


def test_without_a_process_group_peers_nothing_moves():
    tensor = torch.ones(3)
    assert on_collective_device(tensor, torch.device("cpu")) is tensor
    assert on_collective_device(tensor, torch.device("meta")).device.type == "meta"


def test_served_devices_follow_the_backend(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert served_devices(None) == ["cpu"]
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert served_devices(None) == ["cuda:3"]


def test_broadcast_tensors_is_a_collective():
    """Without a process group it has nothing to talk to (callers check for one first)."""
    with pytest.raises((RuntimeError, ValueError)):
        broadcast_tensors([torch.ones(2)], torch.device("cpu"), src=0)
