"""The public ``Fabric`` API at world size 1, run for real on the CPU."""

from __future__ import annotations

import copy
import math
import os
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fabric as fabric_package
from fabric import Fabric
from fabric.accelerators import CPUAccelerator
from fabric.strategies.single_device import SingleDeviceStrategy
from fabric.strategies.strategy import Strategy
from fabric.wrappers import FabricDataLoader, FabricModule, FabricOptimizer

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def cpu_fabric(**kwargs) -> Fabric:
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("devices", 1)
    return Fabric(**kwargs)


def meta_fabric() -> Fabric:
    """A single-device Fabric whose device is "meta": it shows where things move (CPU accelerator, as "auto" picks a GPU)."""
    return Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(device="meta"))


# ---- the user snippet ---------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true", "64-true", "bf16-true"])
def test_user_snippet(tmp_path, monkeypatch, precision):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(torch.randn(12, 4), batch_size=4)
    initial = copy.deepcopy(model.state_dict())

    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for batch in loader:
        batch = fabric.batch_to_device(batch)
        loss = model(batch).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save("ckpt.pt", {"model": model, "optimizer": optimizer, "step": 3})
    trained = copy.deepcopy(model.state_dict())
    assert not torch.equal(trained["weight"].float(), initial["weight"]), "the loop must have trained the model"

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    left = fabric.load("ckpt.pt", {"model": model, "optimizer": optimizer})
    assert left == {"step": 3}
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key])


# ---- launch -------------------------------------------------------------------------------------


def test_launch_runs_function_with_fabric_first_and_returns_its_value():
    fabric = cpu_fabric()
    seen = {}

    def work(f, a, b=0):
        seen["fabric"] = f
        return a + b

    assert fabric.launch(work, 2, b=3) == 5
    assert seen["fabric"] is fabric


def test_launch_without_function_returns_none():
    assert cpu_fabric().launch() is None


def test_launch_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match=r"launch\(function=\.\.\.\) takes a callable, got 'train'"):
        cpu_fabric().launch("train")


@pytest.mark.parametrize("first", [(), (lambda f: None,)])
def test_launch_twice_sets_up_once_and_runs_again(first):
    """As Lightning Fabric's: a second launch keeps the process as it is and runs its function (none: nothing)."""
    fabric = cpu_fabric()
    fabric.launch(*first)
    calls = []
    assert fabric.launch() is None
    assert fabric.launch(lambda f: calls.append(f) or "again") == "again" and calls == [fabric]


def test_exception_in_launched_function_propagates():
    def fail(f):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        cpu_fabric().launch(fail)


# ---- set-up -------------------------------------------------------------------------------------


def test_setup_returns_wrappers_in_order():
    fabric = cpu_fabric()
    model = make_model()
    opt1 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt2 = torch.optim.Adam(model[2].parameters(), lr=0.1)
    fmodel, fopt1, fopt2 = fabric.setup(model, opt1, opt2)
    assert isinstance(fmodel, FabricModule) and fmodel.module is model
    assert isinstance(fopt1, FabricOptimizer) and isinstance(fopt1, torch.optim.SGD) and fopt1.optimizer is opt1
    assert isinstance(fopt2, FabricOptimizer) and isinstance(fopt2, torch.optim.Adam) and fopt2.optimizer is opt2
    alone = fabric.setup(make_model())
    assert isinstance(alone, FabricModule)


def test_setup_rejects_wrong_types():
    fabric = cpu_fabric()
    with pytest.raises(TypeError, match=r"torch\.nn\.Module, got str"):
        fabric.setup("model")
    with pytest.raises(TypeError, match="Optimizer instances, got dict"):
        fabric.setup(make_model(), {"lr": 0.1})


@pytest.mark.parametrize("move", [True, False])
def test_setup_module_move_to_device(move):
    fabric = meta_fabric()
    model = make_model()
    fmodel = fabric.setup_module(model, move_to_device=move)
    expected = "meta" if move else "cpu"
    assert {p.device.type for p in fmodel.parameters()} == {expected}
    model2 = make_model()
    fmodel2 = fabric.setup(model2, move_to_device=move)
    assert {p.device.type for p in fmodel2.parameters()} == {expected}


def test_setup_optimizers():
    fabric = cpu_fabric()
    model = make_model()
    fmodel = fabric.setup_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    single = fabric.setup_optimizers(opt)
    assert isinstance(single, FabricOptimizer) and single.optimizer is opt
    a, b = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.2)
    pair = fabric.setup_optimizers(a, b)
    assert isinstance(pair, tuple) and [o.optimizer for o in pair] == [a, b]
    # the module and optimizer set up separately still train together
    before = model[0].weight.detach().clone()
    fabric.backward(fmodel(torch.randn(3, 4)).sum())
    single.step()
    assert not torch.equal(model[0].weight, before)


def test_setup_dataloaders_at_world_size_one_keeps_the_loader():
    fabric = cpu_fabric()
    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=3, shuffle=True)
    wrapped = fabric.setup_dataloaders(loader, use_distributed_sampler=True)
    assert isinstance(wrapped, FabricDataLoader)
    assert wrapped.dataloader is loader  # nothing to shard with one process
    assert sorted(torch.cat([b[0] for b in wrapped]).tolist()) == list(range(10))
    first, second = fabric.setup_dataloaders(DataLoader(data), DataLoader(data), use_distributed_sampler=False)
    assert isinstance(first, FabricDataLoader) and isinstance(second, FabricDataLoader)


@pytest.mark.parametrize("move", [True, False])
def test_setup_dataloaders_move_to_device(move):
    fabric = meta_fabric()
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2), move_to_device=move)
    assert loader.device == (torch.device("meta") if move else None)
    devices = {batch[0].device.type for batch in loader}
    assert devices == {"meta" if move else "cpu"}


def test_setup_dataloaders_rejects_what_is_not_a_dataloader():
    with pytest.raises(TypeError, match=r"takes torch\.utils\.data\.DataLoader objects, got int"):
        cpu_fabric().setup_dataloaders(3)


# ---- the training step --------------------------------------------------------------------------


def test_backward_gives_the_same_gradients_as_raw_backward():
    fabric = cpu_fabric()
    raw = make_model()
    ours = fabric.setup(make_model())
    x = torch.randn(5, 4)
    raw(x).pow(2).sum().backward()
    fabric.backward(ours(x).pow(2).sum(), model=ours)
    for p_raw, p_ours in zip(raw.parameters(), ours.parameters()):
        assert torch.equal(p_raw.grad, p_ours.grad)


def _model_with_grads(scale: float = 10.0):
    fabric = cpu_fabric()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fmodel, foptimizer = fabric.setup(model, optimizer)
    fabric.backward(scale * fmodel(torch.randn(6, 4)).sum())
    return fabric, fmodel, foptimizer


def _copy_with_grads(module: nn.Module) -> nn.Module:
    reference = copy.deepcopy(module)  # (deepcopy does not copy a Parameter's .grad)
    for p_ref, p in zip(reference.parameters(), module.parameters()):
        p_ref.grad = p.grad.clone()
    return reference


def test_clip_gradients_by_norm_matches_torch_and_returns_the_total_norm():
    fabric, fmodel, foptimizer = _model_with_grads()
    reference = _copy_with_grads(fmodel.module)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    norm = fabric.clip_gradients(fmodel, foptimizer, max_norm=0.5)
    assert isinstance(norm, torch.Tensor)
    assert torch.allclose(norm, expected_norm)
    assert norm > 0.5
    for p_ref, p in zip(reference.parameters(), fmodel.parameters()):
        assert torch.allclose(p_ref.grad, p.grad)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in fmodel.parameters()]))
    assert clipped == pytest.approx(0.5, rel=1e-4)


def test_clip_gradients_by_norm_other_norm_type():
    fabric, fmodel, foptimizer = _model_with_grads()
    reference = _copy_with_grads(fmodel.module)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1.0, norm_type=math.inf)
    assert torch.allclose(fabric.clip_gradients(fmodel, foptimizer, max_norm=1.0, norm_type=math.inf), expected)


def test_clip_gradients_by_value():
    fabric, fmodel, foptimizer = _model_with_grads()
    before = [p.grad.clone() for p in fmodel.parameters()]
    assert max(g.abs().max().item() for g in before) > 0.01
    assert fabric.clip_gradients(fmodel, foptimizer, clip_val=0.01) is None
    for old, p in zip(before, fmodel.parameters()):
        assert torch.equal(p.grad, old.clamp(-0.01, 0.01))


def test_clip_gradients_needs_exactly_one_of_value_and_norm():
    fabric, fmodel, foptimizer = _model_with_grads()
    with pytest.raises(ValueError, match=r"clip_val or max_norm, not both \(got 1.0 and 2.0\)"):
        fabric.clip_gradients(fmodel, foptimizer, clip_val=1.0, max_norm=2.0)
    with pytest.raises(ValueError, match=r"needs clip_val .* or max_norm"):
        fabric.clip_gradients(fmodel, foptimizer)


def test_clip_gradients_non_finite():
    fabric, fmodel, foptimizer = _model_with_grads()
    next(fmodel.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(fmodel, foptimizer, max_norm=1.0)
    norm = fabric.clip_gradients(fmodel, foptimizer, max_norm=1.0, error_if_nonfinite=False)
    assert torch.isnan(norm)


def test_autocast_bf16_mixed_gives_bf16_matmuls():
    fabric = cpu_fabric(precision="bf16-mixed")
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with fabric.autocast():
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32
    with cpu_fabric().autocast():
        assert (a @ b).dtype == torch.float32


def test_to_device_and_batch_to_device():
    fabric = meta_fabric()
    module = make_model()
    assert fabric.to_device(module) is module
    assert {p.device.type for p in module.parameters()} == {"meta"}
    batch = {"x": torch.ones(2), "y": [torch.zeros(1), 3], "name": "a"}
    for moved in (fabric.to_device(batch), fabric.batch_to_device(batch)):
        assert moved["x"].device.type == "meta" and moved["y"][0].device.type == "meta"
        assert moved["y"][1] == 3 and moved["name"] == "a"
    assert fabric.to_device(torch.ones(1)).device.type == "meta"
    cpu = cpu_fabric()
    tensor = torch.ones(2)
    assert cpu.to_device(tensor) is tensor


def test_print_only_prints(capsys):
    fabric = cpu_fabric()
    fabric.print("hello", 3, sep="-", end="!\n")
    assert capsys.readouterr().out == "hello-3!\n"


def test_init_module_device_and_dtype():
    with meta_fabric().init_module():
        model = nn.Linear(2, 2)
    assert model.weight.device.type == "meta"
    with cpu_fabric(precision="64-true").init_module():
        model = nn.Linear(2, 2)
    assert model.weight.dtype == torch.float64
    with cpu_fabric(precision="bf16-true").init_module():
        model = nn.Linear(2, 2)
    assert model.weight.dtype == torch.bfloat16
    with cpu_fabric(precision="bf16-mixed").init_module():
        model = nn.Linear(2, 2)
    assert model.weight.dtype == torch.float32  # mixed precision keeps float32 weights
    assert torch.get_default_dtype() == torch.float32


class _InitsToSeven(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), 3.0))
        nn.init.constant_(self.weight, 7.0)


def test_init_module_empty_init_skips_initialization():
    fabric = cpu_fabric()
    with fabric.init_module(empty_init=True):
        skipped = _InitsToSeven()
    assert torch.equal(skipped.weight.detach(), torch.full((4,), 3.0))
    with fabric.init_module(empty_init=False):
        initialized = _InitsToSeven()
    assert torch.equal(initialized.weight.detach(), torch.full((4,), 7.0))

    # a standard layer's random initialization does not draw from the generator
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with fabric.init_module(empty_init=True):
        nn.Linear(16, 16)
    assert torch.equal(torch.rand(3), expected_next)
    torch.manual_seed(123)
    with fabric.init_module():
        nn.Linear(16, 16)
    assert not torch.equal(torch.rand(3), expected_next)


def test_init_contexts_change_nothing_until_entered():
    fabric = cpu_fabric(precision="64-true")
    context = fabric.init_module()
    assert torch.get_default_dtype() == torch.float32
    tensor_context = fabric.init_tensor()
    assert torch.get_default_dtype() == torch.float32
    with context:
        assert torch.get_default_dtype() == torch.float64
    with tensor_context:
        assert torch.empty(1).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_init_tensor():
    with cpu_fabric(precision="bf16-true").init_tensor():
        assert torch.empty(2).dtype == torch.bfloat16
    with meta_fabric().init_tensor():
        assert torch.empty(2).device.type == "meta"
    with cpu_fabric().init_tensor():
        assert torch.empty(2).dtype == torch.float32


def _draw():
    return random.random(), np.random.rand(), torch.rand(1).item()


def test_seed_everything_method_and_function():
    assert Fabric.seed_everything(42) == 42
    first = _draw()
    assert os.environ["FABRIC_GLOBAL_SEED"] == "42"
    assert os.environ["FABRIC_SEED_WORKERS"] == "1"  # the method seeds workers by default
    assert cpu_fabric().seed_everything(42) == 42
    assert _draw() == first
    assert fabric_package.seed_everything(42) == 42
    assert os.environ["FABRIC_SEED_WORKERS"] == "0"
    assert _draw() == first
    fabric_package.seed_everything(43)
    assert _draw() != first


def test_rank_zero_first_runs_the_block_once():
    fabric = cpu_fabric()
    runs = []
    for local in (False, True):
        with fabric.rank_zero_first(local=local):
            runs.append(local)
    assert runs == [False, True]


def test_no_backward_sync_accumulates_on_a_single_device():
    fabric = cpu_fabric()
    fmodel = fabric.setup(make_model())
    raw = make_model()
    x1, x2 = torch.randn(2, 4), torch.randn(2, 4)
    with fabric.no_backward_sync(fmodel):
        fabric.backward(fmodel(x1).sum())
    fabric.backward(fmodel(x2).sum())
    raw(x1).sum().backward()
    raw(x2).sum().backward()
    for p_raw, p in zip(raw.parameters(), fmodel.parameters()):
        assert torch.allclose(p.grad, p_raw.grad)
    with fabric.no_backward_sync(fmodel, enabled=False):
        pass
    with pytest.raises(TypeError, match="module returned by setup"), fabric.no_backward_sync(make_model()):
        pass


# ---- collectives at world size 1 ------------------------------------------------------------------


def test_all_reduce_turns_numbers_into_tensors_and_keeps_structure():
    fabric = cpu_fabric()
    data = {"a": 1, "b": [2.5, torch.tensor([1.0, 2.0])], "c": (np.float32(3.0), True), "name": "x"}
    for op in ("mean", "sum", "max", "min"):
        out = fabric.all_reduce(data, reduce_op=op)
        assert set(out) == {"a", "b", "c", "name"}
        assert isinstance(out["a"], torch.Tensor) and out["a"].item() == 1
        assert isinstance(out["b"], list) and out["b"][0].item() == 2.5
        assert torch.equal(out["b"][1], torch.tensor([1.0, 2.0]))
        assert isinstance(out["c"], tuple) and out["c"][0].item() == 3.0 and out["c"][1].item() is True
        assert out["name"] == "x"
    single = fabric.all_reduce(7)
    assert isinstance(single, torch.Tensor) and single.item() == 7


def test_all_reduce_checks_the_reduce_op_at_world_size_one():
    fabric = cpu_fabric()
    with pytest.raises(ValueError, match="reduce_op='median' is not supported; accepted: 'mean', 'avg', 'sum', 'max', 'min'"):
        fabric.all_reduce(torch.ones(1), reduce_op="median")
    with pytest.raises(TypeError, match="reduce_op=3 must be a name"):
        fabric.all_reduce(torch.ones(1), reduce_op=3)
    assert fabric.all_reduce(torch.ones(1), reduce_op="SUM").item() == 1


def test_all_gather_at_world_size_one_adds_no_dimension():
    fabric = cpu_fabric()
    out = fabric.all_gather({"x": torch.ones(2, 3), "n": 4})
    assert out["x"].shape == (2, 3)
    assert isinstance(out["n"], torch.Tensor) and out["n"].item() == 4


def test_broadcast_barrier_and_boolean_decision():
    fabric = cpu_fabric()
    obj = {"any": ["picklable", 1]}
    assert fabric.broadcast(obj) is obj
    assert fabric.barrier() is None and fabric.barrier("named") is None
    for decision in (True, False):
        for all_ranks in (True, False):
            result = fabric.reduce_boolean_decision(decision, all=all_ranks)
            assert result is decision


def test_properties_at_world_size_one():
    fabric = cpu_fabric()
    assert fabric.device == torch.device("cpu")
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (0, 0, 0, 1)
    assert fabric.is_global_zero is True
    assert isinstance(fabric.strategy, Strategy) and isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert fabric.strategy.accelerator is fabric.accelerator


# ---- callbacks and loggers ------------------------------------------------------------------------


class RecordingCallback:
    def __init__(self):
        self.calls = []

    def on_train_epoch_end(self, *args, **kwargs):
        self.calls.append(("on_train_epoch_end", args, kwargs))


class FakeLogger:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((metrics, step))


def test_call_dispatches_to_callbacks_that_have_the_hook():
    first, second = RecordingCallback(), RecordingCallback()
    fabric = cpu_fabric(callbacks=[first, object(), second])
    fabric.call("on_train_epoch_end", 1, loss=2.0)
    fabric.call("hook_nobody_has", 3)
    assert first.calls == second.calls == [("on_train_epoch_end", (1,), {"loss": 2.0})]
    single = RecordingCallback()
    cpu_fabric(callbacks=single).call("on_train_epoch_end")
    assert single.calls == [("on_train_epoch_end", (), {})]


def test_call_skips_a_non_callable_hook_with_a_warning():
    class Broken:
        on_start = 3

    with pytest.warns(UserWarning, match="Broken.on_start: it is not callable"):
        cpu_fabric(callbacks=Broken()).call("on_start")


def test_log_and_log_dict_turn_tensors_into_numbers():
    first, second = FakeLogger(), FakeLogger()
    fabric = cpu_fabric(loggers=[first, second])
    assert fabric.logger is first and fabric.loggers == [first, second]
    fabric.log("loss", torch.tensor(0.5), step=3)
    fabric.log_dict({"acc": torch.tensor([0.25]), "epoch": 1, "name": "run"})
    expected = [({"loss": 0.5}, 3), ({"acc": 0.25, "epoch": 1, "name": "run"}, None)]
    assert first.calls == second.calls == expected
    assert all(type(value) in (float, int, str) for metrics, _ in first.calls for value in metrics.values())
    with pytest.raises(ValueError, match="one-element tensors"):
        fabric.log("vector", torch.ones(3))


def test_logger_without_loggers():
    fabric = cpu_fabric()
    assert fabric.loggers == []
    fabric.log("ignored", 1.0)
    with pytest.raises(RuntimeError, match="no logger"):
        fabric.logger  # noqa: B018 - reading the property is what raises


# ---- checkpoints through Fabric -------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    fabric = cpu_fabric()
    model = fabric.setup(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    path = tmp_path / "sub" / "dir" / "state.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "epoch": 2, "meta": {"lr": [0.1]}})
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())

    fabric.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    left = fabric.load(path, state)
    assert left == {"meta": {"lr": [0.1]}}
    assert state["epoch"] == 2 and state["model"] is model and state["optimizer"] is optimizer
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved_model[key])
    loaded = optimizer.state_dict()
    for index, entry in saved_optimizer["state"].items():
        for name, value in entry.items():
            assert torch.equal(loaded["state"][index][name], value)

    everything = fabric.load(path)
    assert set(everything) == {"model", "optimizer", "epoch", "meta"}
    assert set(everything["model"]) == set(saved_model)


def test_load_raw(tmp_path):
    fabric = cpu_fabric()
    source = make_model(seed=1)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    target = fabric.setup(make_model(seed=2))
    fabric.load_raw(tmp_path / "weights.pt", target)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)
    optimizer = torch.optim.SGD(source.parameters(), lr=0.5)
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    target_opt = fabric.setup_optimizers(torch.optim.SGD(target.parameters(), lr=0.1))
    fabric.load_raw(tmp_path / "opt.pt", target_opt)
    assert target_opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match="Module or an Optimizer, got dict"):
        fabric.load_raw(tmp_path / "weights.pt", {})


def test_save_rejects_a_non_dict_state(tmp_path):
    with pytest.raises(TypeError, match="takes a dict, got list"):
        cpu_fabric().save(tmp_path / "x.pt", [1, 2])
