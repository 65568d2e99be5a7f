"""DataParallelStrategy on the CPU: one process, no launch, collectives are identities."""

from __future__ import annotations

import pytest
import torch
from torch.nn import DataParallel
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from fabric import Fabric
from fabric.strategies import DataParallelStrategy


@pytest.fixture
def fabric(monkeypatch):
    for name in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # an instance: the name "dp" on the CPU means DDP (see the test below)
    return Fabric(accelerator="cpu", strategy=DataParallelStrategy(), devices=1)


@pytest.mark.parametrize("devices", [1, 2])
def test_dp_by_name_on_the_cpu_warns_and_uses_ddp(devices, monkeypatch):
    from fabric.strategies import DDPStrategy

    for name in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning, match="strategy='dp' is not supported on the CPU; using strategy='ddp'"):
        fabric = Fabric(accelerator="cpu", strategy="dp", devices=devices)
    assert isinstance(fabric.strategy, DDPStrategy)
    assert fabric.strategy.requires_launch
    # DDP shards the data: each rank gets its own part (DataParallel would have given each the whole batch)
    assert fabric.strategy.distributed_sampler_kwargs == {"num_replicas": devices, "rank": 0}


def test_dp_on_the_cpu_stays_there_on_a_machine_with_gpus(fabric, monkeypatch):
    """torch's DataParallel given no device ids takes every GPU there is; a job that asked for the CPU keeps it."""
    import importlib

    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")  # the module, not its function
    monkeypatch.setattr(data_parallel, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(data_parallel, "_get_all_device_indices", lambda: [0])
    wrapped = fabric.setup_module(torch.nn.Linear(3, 1))
    assert isinstance(wrapped._forward_module, DataParallel)
    assert next(wrapped.parameters()).device.type == "cpu"
    assert wrapped(torch.ones(2, 3)).device.type == "cpu"


def test_dp_strategy_shape(fabric):
    strategy = fabric.strategy
    assert isinstance(strategy, DataParallelStrategy)
    assert strategy.requires_launch is False and strategy.launcher is None
    assert strategy.root_device == torch.device("cpu") == fabric.device
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (0, 0, 0, 1)
    assert fabric.is_global_zero
    assert strategy.distributed_sampler_kwargs is None
    assert strategy.backward_sync_control is None


def test_dp_trains_without_launch_and_keeps_state_dict_keys(fabric, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(wrapped._forward_module, DataParallel)
    x = torch.randn(8, 3)
    fabric.backward(wrapped(x).pow(2).mean())
    optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).pow(2).mean().backward()
    reference_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)

    keys = ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(wrapped.state_dict()) == keys
    assert sorted(fabric.strategy.get_module_state_dict(wrapped._forward_module)) == keys
    fabric.save(tmp_path / "dp.pt", {"model": wrapped, "optimizer": optimizer})
    on_disk = torch.load(tmp_path / "dp.pt", weights_only=True)
    assert sorted(on_disk["model"]) == keys
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    fabric.strategy.load_module_state_dict(DataParallel(fresh), on_disk["model"])
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_dp_collectives_are_identities(fabric):
    data = {"a": torch.tensor([1.0, 2.0]), "b": [3, 4.5]}
    reduced = fabric.all_reduce(data, reduce_op="sum")
    assert torch.equal(reduced["a"], data["a"]) and [int(reduced["b"][0]), float(reduced["b"][1])] == [3, 4.5]
    assert torch.equal(fabric.all_gather(torch.tensor([1, 2])), torch.tensor([1, 2]))
    assert fabric.broadcast({"x": 1}) == {"x": 1}
    fabric.barrier()
    assert fabric.reduce_boolean_decision(True) and not fabric.reduce_boolean_decision(False, all=False)
    with pytest.raises(ValueError, match="'median'"):
        fabric.all_reduce(torch.ones(1), reduce_op="median")


def test_dp_dataloader_not_sharded_and_batches_on_root_device(fabric):
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(6)), batch_size=4))
    assert isinstance(loader.sampler, SequentialSampler)
    assert loader.device == torch.device("cpu")
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5]]


def test_dp_with_no_backward_sync_is_a_no_op(fabric):
    model = fabric.setup(torch.nn.Linear(2, 1))
    with fabric.no_backward_sync(model):
        fabric.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None
