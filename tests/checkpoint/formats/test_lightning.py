"""Sharded checkpoint folders in Lightning Fabric's layout (``.metadata`` + shards + ``meta.pt``, no
``fabric-objects.pt``) load with ``fabric.load`` and ``consolidate``, with the same checks as our folders.

The folders are written here with torch alone, as Lightning's sharded save writes them (the 2-process
FSDP job of ``support/scripts/dcp/job.py``, and ``dcp.save`` in this process): the tests need no Lightning.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fabric import Fabric
from fabric.checkpoint.formats import choose, load_sharded
from fabric.checkpoint.formats.file import CheckpointLoadError, UnsafeCheckpointError
from fabric.checkpoint.formats.lightning import LIGHTNING
from fabric.checkpoint.formats.shard_reader import read_index
from fabric.checkpoint.formats.sharded import SHARDED
from fabric.checkpoint.storage import locate
from support.dcp_jobs import job_model, run_job
from support.environment import clean_env

NOTE = {"text": "hi", "rank_zero": True}


def plain_model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = job_model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def assert_same_state(actual: dict, expected: dict) -> None:
    """``expected``: the reference of the FSDP job (optimizer state in numbered form)."""
    assert actual["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(actual["model"][name], value), name
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for number, entry in expected["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(actual["optimizer"]["state"][number][name]), torch.as_tensor(value)), (number, name)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_lightning_layout_from_two_fsdp_processes_loads_into_one_plain_process(saved_on_two):
    folder = saved_on_two / "lightning-layout"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    lightning, ours = locate(folder), locate(saved_on_two / "sharded")
    assert choose(lightning.detect(), lightning) is LIGHTNING and choose(ours.detect(), ours) is SHARDED
    reference = torch.load(saved_on_two / "reference-rank0.pt", weights_only=True)
    model, optimizer = plain_model_and_optimizer(seed=3)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = Fabric(accelerator="cpu", devices=1).load(folder, state)
    assert state["step"] == 3 and remainder == {"note": NOTE}
    assert_same_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, reference)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_lightning_layout_loads_into_two_sharded_processes(saved_on_two, tmp_path):
    reference = torch.load(saved_on_two / "reference-rank0.pt", weights_only=True)
    run_job(2, str(tmp_path), "load", str(saved_on_two / "lightning-layout"))
    for rank in range(2):
        loaded = torch.load(tmp_path / f"loaded-lightning-layout-rank{rank}.pt", weights_only=True)
        assert loaded["world_size"] == 2 and loaded["step"] == 3 and loaded["remainder"] == {"note": NOTE}
        assert_same_state(loaded, reference)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_consolidate_reads_the_lightning_layout(saved_on_two, tmp_path):
    out = tmp_path / "whole.pt"
    subprocess.run(
        [sys.executable, "-m", "fabric", "consolidate", str(saved_on_two / "lightning-layout"), str(out)],
        check=True,
        env=clean_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        timeout=120,
    )
    whole = torch.load(out, weights_only=True)  # plain torch.load, safely
    reference = torch.load(saved_on_two / "reference-rank0.pt", weights_only=True)
    assert whole["step"] == 3 and whole["note"] == NOTE
    for name, value in reference["model"].items():
        assert torch.equal(whole["model"][name], value), name
    # the optimizer as the layout keeps it (states by parameter name, as Lightning's consolidate writes it)
    assert sorted(whole["optimizer"]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert whole["optimizer"]["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # ... which fabric.load puts into a plain optimizer
    model, optimizer = plain_model_and_optimizer(seed=3)
    load_sharded(out, {"model": model, "optimizer": optimizer})
    assert_same_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, reference)


# ---- one process: folders written here ---------------------------------------------------------------------


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = plain_model_and_optimizer(seed=1)
    model(torch.randn(5, 6)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def write_lightning_layout(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict, **extra) -> None:
    sharded = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer), **extra}
    dcp.save(sharded, checkpoint_id=folder, no_dist=True)
    torch.save(meta, folder / "meta.pt")


class Opaque:
    """Restorable only by running pickled code."""

    def __init__(self, value: int = 1) -> None:
        self.value = value


def test_one_process_roundtrip_and_whole_read(tmp_path):
    model, optimizer = trained()
    write_lightning_layout(tmp_path / "ckpt", model, optimizer, {"step": 7, "loader": {"epoch": 2}})
    fresh, fresh_optimizer = plain_model_and_optimizer(seed=2)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    remainder = load_sharded(tmp_path / "ckpt", state)
    assert state["step"] == 7 and remainder == {"loader": {"epoch": 2}}
    expected = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    actual = {"model": fresh.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    assert_same_state(actual, expected)
    # without a state: everything, tensors whole; hyperparameters as saved (betas a tuple)
    whole = load_sharded(tmp_path / "ckpt")
    assert whole["step"] == 7 and whole["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(whole["model"]["0.weight"], model[0].weight.detach())


def test_a_flipped_bit_in_a_shard_is_refused_before_anything_changes(tmp_path):
    model, optimizer = trained()
    write_lightning_layout(tmp_path / "ckpt", model, optimizer, {"step": 7})
    item, info = max(read_index(tmp_path / "ckpt").storage_data.items(), key=lambda pair: pair[1].length)
    shard = tmp_path / "ckpt" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10  # in the largest tensor's bytes
    shard.write_bytes(bytes(data))
    target, target_optimizer = plain_model_and_optimizer(seed=2)
    before = {name: value.clone() for name, value in target.state_dict().items()}
    with pytest.raises(CheckpointLoadError, match="damaged") as caught:
        load_sharded(tmp_path / "ckpt", {"model": target, "optimizer": target_optimizer})
    assert info.relative_path in str(caught.value) and item.fqn in str(caught.value)
    assert all(torch.equal(before[name], value) for name, value in target.state_dict().items())
    assert not target_optimizer.state


def test_pickled_objects_are_refused_unless_the_caller_opts_out(tmp_path):
    model, optimizer = trained()
    write_lightning_layout(tmp_path / "meta", model, optimizer, {"step": 7, "thing": Opaque()})
    with pytest.raises(CheckpointLoadError, match="weights_only=False"):
        load_sharded(tmp_path / "meta", {"model": plain_model_and_optimizer(seed=2)[0]}, strict=False)
    assert isinstance(load_sharded(tmp_path / "meta", weights_only=False)["thing"], Opaque)
    # a non-tensor item of the shards themselves (torch would unpickle it with weights_only=False)
    write_lightning_layout(tmp_path / "item", model, optimizer, {"step": 7}, extra={"thing": Opaque()})
    with pytest.raises(UnsafeCheckpointError, match="weights_only=False"):
        load_sharded(tmp_path / "item")
    assert isinstance(load_sharded(tmp_path / "item", weights_only=False)["extra"]["thing"], Opaque)
