"""What every strategy declares (instead of being probed by name), how it takes the connector's choices,
and the single-process forms of ``reduce``, ``block_backward_sync`` and the save outcome."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.accelerators import CPUAccelerator
from fabric.checkpoint.agreement import Outcome, on_rank_zero
from fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from fabric.plugins.io import TorchCheckpointIO
from fabric.plugins.precision import DoublePrecision, Precision
from fabric.strategies import (
    DataParallelStrategy,
    DDPStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
    ddp,
    fsdp,
    horovod,
    horovod_environment,
    model_parallel,
    sharding,
    single_device,
)
from fabric.strategies.strategy import ConnectorChoices

CPU = torch.device("cpu")
# classes whose overrides must be marked (typing_extensions.override); Horovod's import needs no Horovod
MARKED = [
    ParallelStrategy,
    SingleDeviceStrategy,
    DataParallelStrategy,
    DDPStrategy,
    ddp._DDPBackwardSyncControl,
    ddp.ProcessGroupStrategy,
    sharding.ShardedStrategy,
    sharding._ShardedBackwardSyncControl,
    fsdp.FSDPStrategy,
    model_parallel.ModelParallelStrategy,
    horovod.HorovodStrategy,
    horovod_environment.HorovodEnvironment,
    horovod._HorovodBackwardSyncControl,
]


@pytest.fixture(autouse=True)
def no_launcher_variables(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _function_of(attribute):
    if isinstance(attribute, property):
        return attribute.fget
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    return attribute


@pytest.mark.parametrize("cls", MARKED, ids=lambda c: c.__name__)
def test_every_override_is_marked(cls):
    unmarked = []
    for name, attribute in vars(cls).items():
        if name.startswith("__") or not callable(_function_of(attribute)):
            continue
        if any(name in vars(base) for base in cls.__mro__[1:]) and not getattr(_function_of(attribute), "__override__", False):
            unmarked.append(name)
    assert not unmarked, f"{cls.__name__} overrides {unmarked} without @override"


def test_declared_defaults():
    single = SingleDeviceStrategy()
    assert (single.requires_launch, single.moves_batches, single.handles_gradient_accumulation) == (False, True, False)
    assert single.start_method is None and single.launched_externally is False and single.launcher is None
    assert DDPStrategy(start_method="fork").start_method == "fork"
    assert DDPStrategy.requires_launch is True and DataParallelStrategy.requires_launch is False
    assert horovod.HorovodStrategy.handles_gradient_accumulation is True
    for cls in (DDPStrategy, DataParallelStrategy, horovod.HorovodStrategy):
        assert issubclass(cls, ParallelStrategy) and issubclass(cls, Strategy)


def _choices(**overrides):
    values = dict(
        accelerator=CPUAccelerator(),
        precision=Precision(),
        checkpoint_io=None,
        cluster_environment=LightningEnvironment(),
        parallel_devices=[CPU, CPU],
        num_nodes=1,
    )
    values.update(overrides)
    return ConnectorChoices(**values)


def test_accept_choices_fills_only_what_was_not_given():
    precision, io, environment = DoublePrecision(), TorchCheckpointIO(), LightningEnvironment()
    strategy = DDPStrategy(parallel_devices=[CPU] * 3, cluster_environment=environment, precision=precision)
    choices = _choices(num_nodes=2)
    strategy.accept_choices(choices)
    assert strategy.parallel_devices == [CPU] * 3 and strategy.cluster_environment is environment
    assert strategy.precision is precision and strategy.accelerator is choices.accelerator
    assert strategy.num_nodes == 2 and strategy.world_size == 6  # the ranks are set as the choices arrive
    strategy.accept_choices(_choices(checkpoint_io=io))
    assert strategy.checkpoint_io is io  # a checkpoint IO plugin always wins

    empty = DDPStrategy()
    empty.accept_choices(choices)
    assert empty.parallel_devices == [CPU, CPU] and empty.cluster_environment is choices.cluster_environment


def test_data_parallel_takes_no_cluster_environment_even_under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    strategy = DataParallelStrategy()
    strategy.accept_choices(_choices(cluster_environment=TorchElasticEnvironment(), parallel_devices=[CPU]))
    assert strategy.cluster_environment is None
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.launched_externally) == (1, 0, 0, False)


def test_a_custom_strategy_without_parallel_attributes_is_completed():
    class Custom(SingleDeviceStrategy):
        pass

    fabric = Fabric(accelerator="cpu", strategy=Custom(), precision="64-true")
    assert isinstance(fabric.strategy.precision, DoublePrecision) and fabric.world_size == 1


@pytest.mark.parametrize("strategy", [SingleDeviceStrategy(), DataParallelStrategy(parallel_devices=[CPU])])
def test_one_process_strategies_reduce_and_block_backward_sync(strategy):
    tensor = torch.tensor([1.0, 2.0])
    assert strategy.reduce(tensor, reduce_op="sum") is tensor
    assert strategy.reduce(tensor) is tensor
    with pytest.raises(ValueError, match="'median'"):
        strategy.reduce(tensor, reduce_op="median")
    model = nn.Linear(2, 1)
    with strategy.block_backward_sync():
        model(tensor).sum().backward()
    with strategy.block_backward_sync(model):
        model(tensor).sum().backward()
    assert torch.equal(model.weight.grad, 2 * tensor.unsqueeze(0))


def test_ddp_block_backward_sync_without_process_group_needs_nothing_set_up():
    strategy = DDPStrategy(parallel_devices=[CPU], cluster_environment=LightningEnvironment())
    with strategy.block_backward_sync():  # no module was set up: nothing to hold back
        pass
    with pytest.raises(TypeError, match="DistributedDataParallel"), strategy.block_backward_sync(nn.Linear(1, 1)):
        pass


def test_block_backward_sync_keeps_its_signature_with_an_optional_module():
    parameters = inspect.signature(ParallelStrategy.block_backward_sync).parameters
    assert parameters["module"].default is None


def test_a_failed_save_on_one_process_raises_the_original_error(tmp_path):
    class Failing(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            raise PermissionError(f"no writing to {path}")

    fabric = Fabric(accelerator="cpu", plugins=Failing())
    with pytest.raises(PermissionError, match="no writing to"):
        fabric.save(tmp_path / "x.pt", {"step": 1})


def test_save_outcome_of_an_unpicklable_error_class_is_a_runtime_error():
    class LocalError(Exception):
        pass

    with pytest.raises(RuntimeError, match="LocalError: disk on fire"):
        Outcome.of_error(LocalError("disk on fire")).result()
    with pytest.raises(OSError, match="Rank 0 failed to save the checkpoint: full"):
        Outcome.of_error(OSError("full")).result()
    assert Outcome(7).result() == 7  # success: the value


def test_on_rank_zero_runs_the_step_once_and_every_rank_learns_its_outcome():
    ran: list[int] = []
    sent: list[Outcome] = []

    def broadcast(outcome: Outcome) -> Outcome:
        sent.append(outcome)
        return sent[0]  # every rank receives what rank 0 sent

    assert on_rank_zero(lambda: ran.append(0) or "token", rank=0, broadcast=broadcast) == "token"
    assert on_rank_zero(lambda: ran.append(1), rank=1, broadcast=broadcast) == "token" and ran == [0]
    sent.clear()
    with pytest.raises(OSError, match=r"^full$"):  # rank 0 raises its own error
        on_rank_zero(lambda: (_ for _ in ()).throw(OSError("full")), rank=0, broadcast=broadcast)
    with pytest.raises(OSError, match="Rank 0 failed to save the checkpoint: full"):
        on_rank_zero(lambda: None, rank=1, broadcast=broadcast)


def test_one_process_collectives_are_shared():
    assert DataParallelStrategy.all_reduce is SingleDeviceStrategy.all_reduce is single_device.OneProcessCollectives.all_reduce


@pytest.mark.parametrize("name", sorted(__import__("fabric.strategies", fromlist=["STRATEGY_REGISTRY"]).STRATEGY_REGISTRY))
def test_the_registry_says_how_processes_start_as_each_class_declares(name):
    from fabric.strategies import STRATEGY_REGISTRY, strategy_class, strategy_launch

    if name == "horovod":
        pytest.importorskip("horovod.torch", reason="HorovodStrategy() needs Horovod (make horovod), as the Horovod tests do")
    cls, kwargs = strategy_class(name)
    strategy = cls(**kwargs)
    declared = {
        "one_per_node": not strategy.requires_launch,
        "from_function": strategy.start_method in ("spawn", "fork", "forkserver"),
        "per_device": strategy.requires_launch and strategy.start_method == "popen",
        "horovodrun": strategy.requires_launch and strategy.start_method is None,
    }
    assert [launch for launch, holds in declared.items() if holds] == [strategy_launch(name)], STRATEGY_REGISTRY[name]


def test_public_contract_members_replace_private_reaches():
    assert DDPStrategy().backward_sync_control is not None and SingleDeviceStrategy().backward_sync_control is None
    assert callable(DDPStrategy().setup_worker) and callable(Strategy.configure_launcher)
