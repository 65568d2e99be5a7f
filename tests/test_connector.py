"""The connector turns arguments (and FABRIC_* variables) into a strategy, or explains what is wrong.

Every error a user can cause must name the argument, the bad value and what is accepted.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator
from fabric.accelerators.cuda import parse_gpu_ids
from fabric.connector import Connector
from fabric.plugins import CheckpointIO, DoublePrecision, MixedPrecision, Precision, TorchCheckpointIO
from fabric.plugins.environments import LightningEnvironment
from fabric.plugins.precision import HalfPrecision
from fabric.strategies.single_device import SingleDeviceStrategy

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def raises(exception, *fragments):
    """``pytest.raises`` that requires every fragment (literally) in the message."""
    return pytest.raises(exception, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ---- what a valid configuration becomes ------------------------------------------------------------


def test_defaults_on_this_machine_give_one_cpu_process():
    if CUDAAccelerator.is_available() or MPSAccelerator.is_available():
        pytest.skip("'auto' picks the GPU here")
    fabric = Fabric()
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert type(fabric.strategy.precision) is Precision
    assert fabric.device == torch.device("cpu")


@pytest.mark.parametrize("accelerator", ["cpu", "CPU", "auto"])
@pytest.mark.parametrize("strategy", ["auto", "single_device", "Single_Device"])
@pytest.mark.parametrize("devices", [1, "1", "auto"])
def test_names_are_case_insensitive_and_devices_accept_strings(accelerator, strategy, devices):
    if accelerator == "auto" and (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
        pytest.skip("'auto' picks the GPU here")
    connector = Connector(accelerator=accelerator, strategy=strategy, devices=devices)
    assert isinstance(connector.strategy, SingleDeviceStrategy)
    assert connector.parallel_devices == [torch.device("cpu")]


def test_a_strategy_instance_is_completed_and_kept():
    strategy = SingleDeviceStrategy(device="cpu")
    fabric = Fabric(accelerator="cpu", strategy=strategy, precision="64-true")
    assert fabric.strategy is strategy
    assert isinstance(strategy.accelerator, CPUAccelerator)
    assert isinstance(strategy.precision, DoublePrecision)


def test_a_strategy_instance_keeps_its_own_precision():
    precision = HalfPrecision("bf16-true")
    strategy = SingleDeviceStrategy(device="cpu", precision=precision)
    assert Fabric(accelerator="cpu", strategy=strategy).strategy.precision is precision


def test_plugins_are_used():
    io, precision, environment = TorchCheckpointIO(), DoublePrecision(), LightningEnvironment()
    fabric = Fabric(accelerator="cpu", plugins=[io, precision, environment])
    assert fabric.strategy.checkpoint_io is io and fabric.strategy.precision is precision
    assert Connector(accelerator="cpu", plugins=[environment]).cluster_environment is environment
    single = Fabric(accelerator="cpu", plugins=MixedPrecision("bf16-mixed", "cpu"))
    assert single.strategy.precision.precision == "bf16-mixed"


def test_a_checkpoint_io_plugin_does_the_saving(tmp_path):
    class RecordingIO(TorchCheckpointIO):
        def __init__(self):
            self.saved = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.saved.append(path)
            super().save_checkpoint(checkpoint, path, storage_options)

    io = RecordingIO()
    fabric = Fabric(accelerator="cpu", plugins=io)
    fabric.save(tmp_path / "a.pt", {"x": 1})
    assert io.saved == [tmp_path / "a.pt"]
    assert fabric.load(tmp_path / "a.pt") == {"x": 1}


# ---- names that do not exist ------------------------------------------------------------------------


def test_unknown_strategy():
    with raises(ValueError, "strategy='fast'", "accepted", "'auto'", "'single_device'", "'ddp'", "'ddp_spawn'"):
        Fabric(accelerator="cpu", strategy="fast")


@pytest.mark.parametrize(
    ("argument", "typo", "meant"),
    [("strategy", "ddp_spwan", "ddp_spawn"), ("strategy", "fsdp2", "fsdp"), ("accelerator", "cpus", "cpu"),
     ("accelerator", "CUDA0", "cuda"), ("precision", "bf16mixed", "bf16-mixed"), ("precision", "16_true", "16-true")],
)
def test_a_misspelt_name_is_answered_with_the_closest_accepted_one(argument, typo, meant):
    with raises(ValueError, f"{argument}={typo!r}", "accepted", f"; did you mean {meant!r}?"):
        Fabric(**{"accelerator": "cpu", argument: typo})


def test_a_name_close_to_none_gets_no_guess():
    for kwargs in ({"strategy": "fast"}, {"accelerator": "tpux"}, {"precision": "half"}):
        with pytest.raises(ValueError, match="accepted") as info:
            Fabric(**{"accelerator": "cpu", **kwargs})
        assert "did you mean" not in str(info.value)


def test_strategy_of_a_wrong_type():
    with raises(TypeError, "strategy=3", "name or a Strategy instance", "int"):
        Fabric(accelerator="cpu", strategy=3)


def test_unknown_accelerator():
    with raises(ValueError, "accelerator='tpu'", "accepted", "'auto'", "'gpu'", "'cpu'", "'cuda'", "'mps'"):
        Fabric(accelerator="tpu")


def test_accelerator_of_a_wrong_type():
    with raises(TypeError, "accelerator=1.5", "name or an Accelerator instance"):
        Fabric(accelerator=1.5)


@pytest.mark.parametrize("precision", ["8-true", "fp16", "half", 8, "bf32"])
def test_unknown_precision(precision):
    with raises(
        ValueError, f"precision={precision!r}", "accepted", "'32-true'", "'64-true'", "'16-mixed'",
        "'bf16-mixed'", "'16-true'", "'bf16-true'",
    ):  # fmt: skip
        Fabric(accelerator="cpu", precision=precision)


def test_sixteen_bit_mixed_on_the_cpu_falls_back_to_bf16_mixed():
    for precision in ("16-mixed", 16):  # the alias means 16-mixed
        with pytest.warns(UserWarning, match="precision='16-mixed' is not supported on the CPU"):
            fabric = Fabric(accelerator="cpu", precision=precision)
        assert fabric.strategy.precision.precision == "bf16-mixed"


# ---- devices and nodes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [0, -2, -1, "two", "0", 1.5, True, [], [0], "0,1", None])
def test_invalid_cpu_devices(devices):
    with raises(ValueError, f"devices={devices!r}", "CPU accelerator", "accepted", "positive int", "'auto'"):
        Fabric(accelerator="cpu", devices=devices)


def test_empty_device_list_for_cuda():
    # the CUDA path is tested through its pure parser: this machine may have no GPU
    with raises(ValueError, "devices=[]", "CUDA accelerator", "accepted", "'auto'", "-1", "positive int", "'0,1'", "[0, 1]"):
        parse_gpu_ids([], 2, "cuda")


@pytest.mark.parametrize("num_nodes", [0, -1, "x", "2", 1.0, True, None])
def test_invalid_num_nodes(num_nodes):
    with raises(ValueError, f"num_nodes={num_nodes!r}", "accepted", "int >= 1"):
        Fabric(accelerator="cpu", num_nodes=num_nodes)


def test_single_device_strategy_with_several_devices():
    with raises(ValueError, "strategy='single_device'", "devices=2", "strategy='ddp'"):
        Fabric(accelerator="cpu", strategy="single_device", devices=2)


@pytest.mark.parametrize(("accelerator", "available"), [("cuda", CUDAAccelerator), ("mps", MPSAccelerator)])
def test_unavailable_accelerator(accelerator, available):
    if available.is_available():
        pytest.skip(f"{accelerator} is available here")
    with raises(RuntimeError, f"accelerator='{accelerator}'", "not available"):
        Fabric(accelerator=accelerator)


def test_gpu_alias_without_a_gpu():
    if CUDAAccelerator.is_available() or MPSAccelerator.is_available():
        pytest.skip("a GPU is available here")
    with raises(RuntimeError, "accelerator='gpu'", "neither a CUDA nor an MPS device is available"):
        Fabric(accelerator="gpu")


def test_gpu_alias_picks_the_gpu_when_there_is_one():
    if not (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
        pytest.skip("no GPU here")
    fabric = Fabric(accelerator="gpu", devices=1)
    assert fabric.device.type in ("cuda", "mps")


# ---- plugins --------------------------------------------------------------------------------------


@pytest.mark.parametrize("plugin", ["bf16", 3, nn.Linear(1, 1), [DoublePrecision(), object()]])
def test_plugins_of_a_wrong_type(plugin):
    with raises(TypeError, "plugins got", "accepted", "Precision", "CheckpointIO", "ClusterEnvironment"):
        Fabric(accelerator="cpu", plugins=plugin)


def test_two_plugins_of_one_kind():
    with raises(ValueError, "more than one Precision"):
        Fabric(accelerator="cpu", plugins=[DoublePrecision(), HalfPrecision()])
    with raises(ValueError, "more than one CheckpointIO"):
        Fabric(accelerator="cpu", plugins=[TorchCheckpointIO(), TorchCheckpointIO()])


def test_precision_argument_and_precision_plugin_together():
    with raises(ValueError, "precision='64-true'", "precision plugin", "only one"):
        Fabric(accelerator="cpu", precision="64-true", plugins=DoublePrecision())


def test_custom_checkpoint_io_must_implement_the_contract():
    class Incomplete(CheckpointIO):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


# ---- save(filter=...) and load of a missing file ----------------------------------------------------


def test_filter_errors(tmp_path):
    fabric = Fabric(accelerator="cpu")
    state = {"model": nn.Linear(2, 2), "step": 1}
    with raises(TypeError, "save(filter=...)", "dict of state key -> callable", "list"):
        fabric.save(tmp_path / "a.pt", state, filter=[lambda k, v: True])
    with raises(TypeError, "save(filter={'model': ...})", "callable (name, value) -> bool", "'weight'"):
        fabric.save(tmp_path / "a.pt", state, filter={"model": "weight"})
    with raises(ValueError, "save(filter=...)", "'optimizer'", "not in state", "['model', 'step']"):
        fabric.save(tmp_path / "a.pt", state, filter={"optimizer": lambda k, v: True})
    with raises(TypeError, "filter['step']", "int"):
        fabric.save(tmp_path / "a.pt", state, filter={"step": lambda k, v: True})
    assert not (tmp_path / "a.pt").exists()


def test_load_of_a_missing_file(tmp_path):
    missing = tmp_path / "nowhere" / "ckpt.pt"
    fabric = Fabric(accelerator="cpu")
    with raises(FileNotFoundError, str(missing)):
        fabric.load(missing)
    with raises(FileNotFoundError, str(missing)):
        fabric.load(missing, {"model": nn.Linear(1, 1)})
    with raises(FileNotFoundError, str(missing)):
        fabric.load_raw(missing, nn.Linear(1, 1))


# ---- FABRIC_* variables (set by `fabric run`) -------------------------------------------------------


def test_environment_variables_are_picked_up(monkeypatch):
    monkeypatch.setenv("FABRIC_ACCELERATOR", "cpu")
    monkeypatch.setenv("FABRIC_STRATEGY", "single_device")
    monkeypatch.setenv("FABRIC_DEVICES", "1")
    monkeypatch.setenv("FABRIC_NUM_NODES", "1")
    monkeypatch.setenv("FABRIC_PRECISION", "bf16-mixed")
    fabric = Fabric()
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.strategy.precision, MixedPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"
    # the same value in the code and on the command line is no conflict
    same = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", strategy="single_device", num_nodes=1)
    assert same.strategy.precision.precision == "bf16-mixed"


def test_environment_precision_is_used_when_the_code_has_none(monkeypatch):
    monkeypatch.setenv("FABRIC_PRECISION", "64-true")
    fabric = Fabric(accelerator="cpu")
    assert isinstance(fabric.strategy.precision, DoublePrecision)


@pytest.mark.parametrize(
    ("variable", "value", "argument", "code_value"),
    [
        ("FABRIC_PRECISION", "bf16-mixed", "precision", "64-true"),
        ("FABRIC_ACCELERATOR", "cpu", "accelerator", "cuda"),
        ("FABRIC_DEVICES", "2", "devices", 1),
        ("FABRIC_STRATEGY", "ddp", "strategy", "single_device"),
        ("FABRIC_NUM_NODES", "2", "num_nodes", 3),
    ],
)
def test_environment_conflicts_with_the_code(monkeypatch, variable, value, argument, code_value):
    monkeypatch.setenv(variable, value)
    with raises(ValueError, f"Fabric({argument}={code_value!r})", f"--{argument.replace('_', '-')}={value}",
                "fabric-torch run", f"{variable}={value}"):
        Fabric(**{argument: code_value})


def test_invalid_environment_values(monkeypatch):
    monkeypatch.setenv("FABRIC_NUM_NODES", "x")
    with raises(ValueError, "FABRIC_NUM_NODES='x'", "positive integer"):
        Fabric(accelerator="cpu")
    monkeypatch.delenv("FABRIC_NUM_NODES")
    monkeypatch.setenv("FABRIC_ACCELERATOR", "tpu")
    with raises(ValueError, "accelerator='tpu'", "accepted"):
        Fabric()
    monkeypatch.setenv("FABRIC_ACCELERATOR", "cpu")
    monkeypatch.setenv("FABRIC_DEVICES", "-3")
    with raises(ValueError, "devices=-3", "CPU accelerator"):
        Fabric()
