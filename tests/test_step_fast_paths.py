"""The shortcuts of a training step give what the full paths give.

``FabricModule.__call__`` skips nn.Module's call machinery when it has nothing to do, ``Fabric.backward`` and
``FabricOptimizer.step`` skip the strategy and precision layers when those only call torch, and
``move_data_to_device`` (behind ``Fabric.to_device`` and set-up loaders) returns a batch already on the CPU
without walking it. Each test here sets up the case where a shortcut must NOT be taken, or compares the
shortcut's result with the full path's.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.plugins.precision import DoublePrecision, MixedPrecision, Precision
from fabric.strategies import SingleDeviceStrategy
from fabric.utilities.apply_func import move_data_to_device
from fabric.wrappers import FabricDataLoader, plain_backward, plain_optimizer_step

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def set_up(precision: str | None = "32-true", **kwargs: Any) -> tuple[Fabric, nn.Module, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision, **kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fmodel, foptimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return fabric, model, fmodel, foptimizer


# ---- FabricModule.__call__ -----------------------------------------------------------------------------------


HOOKS = {
    "forward pre-hook": lambda fmodel, calls: fmodel.register_forward_pre_hook(lambda module, args: calls.append(module) or (args[0] * 0,)),
    "forward hook": lambda fmodel, calls: fmodel.register_forward_hook(lambda module, args, output: calls.append(module) or output + 1),
    "backward pre-hook": lambda fmodel, calls: fmodel.register_full_backward_pre_hook(lambda module, grad_out: calls.append(module)),
    "backward hook": lambda fmodel, calls: fmodel.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(module)),
}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_a_hook_on_the_wrapper_runs_as_on_any_module(kind):
    _, model, fmodel, _ = set_up()
    calls: list[nn.Module] = []
    handle = HOOKS[kind](fmodel, calls)
    x = torch.randn(5, 3, requires_grad=True)
    out = fmodel(x)
    out.sum().backward()
    assert calls == [fmodel]
    if kind == "forward pre-hook":
        assert torch.equal(out, model(torch.zeros(5, 3)))
    if kind == "forward hook":
        assert torch.equal(out, model(x) + 1)
    handle.remove()
    fmodel(x).sum().backward()
    assert calls == [fmodel]


@pytest.mark.parametrize("kind", list(HOOKS))
def test_a_hook_on_the_users_module_runs_when_called_through_the_wrapper(kind):
    _, model, fmodel, _ = set_up()
    calls: list[nn.Module] = []
    handle = HOOKS[kind](model, calls)  # registered after set-up, on the module the wrapper calls
    x = torch.randn(5, 3, requires_grad=True)
    out = fmodel(x)
    out.sum().backward()
    assert calls == [model]
    if kind == "forward hook":
        handle.remove()
        assert torch.equal(out, fmodel(x) + 1)


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The modules whose nn.Module call machinery (``_call_impl``) runs during the test, in order."""
    modules: list[nn.Module] = []
    call_impl = nn.Module._call_impl

    def counting_call_impl(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        modules.append(self)
        return call_impl(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", counting_call_impl)
    return modules


def test_the_wrapped_modules_forward_is_called_directly_while_nothing_hooks_it(entered):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(3, 2)
    fmodel = fabric.setup(model)
    x = torch.randn(4, 3)
    assert torch.equal(fmodel(x), model.forward(x)) and entered == []
    model.register_forward_hook(lambda module, args, output: None)
    fmodel(x)
    assert entered == [model]  # with a hook to run, nn.Module's call again


def test_torchs_private_names_check_out_on_the_installed_torch():
    from fabric.utilities import module_call

    assert module_call.SKIPPING_IS_SAFE and module_call.skipping_is_safe()


def test_a_hook_registry_the_check_does_not_know_makes_skipping_unsafe(monkeypatch):
    from fabric.utilities import module_call

    # as if torch's call read a registry of a new name: the instance hooks fabric knows miss one
    monkeypatch.setattr(module_call, "INSTANCE_HOOKS", module_call.INSTANCE_HOOKS[:-1])
    assert not module_call.skipping_is_safe()
    monkeypatch.undo()
    monkeypatch.setattr(module_call, "GLOBAL_HOOKS", (*module_call.GLOBAL_HOOKS[:-1], None))  # a registry gone
    assert not module_call.skipping_is_safe()


def test_when_skipping_is_unsafe_every_call_takes_nn_modules_path(monkeypatch, entered):
    import fabric.wrappers

    monkeypatch.setattr(fabric.wrappers, "SKIPPING_IS_SAFE", False)
    model = nn.Linear(3, 2)
    fmodel = Fabric(accelerator="cpu", devices=1).setup(model)
    fmodel(torch.randn(4, 3))
    assert entered == [fmodel, model]


def test_a_module_class_with_its_own_call_is_called_as_it_wants():
    class Counting(nn.Linear):
        calls = 0

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            type(self).calls += 1
            return super().__call__(*args, **kwargs) * 2

    fabric = Fabric(accelerator="cpu", devices=1)
    model = Counting(3, 2)
    fmodel = fabric.setup(model)
    x = torch.randn(4, 3)
    assert torch.equal(fmodel(x), model.forward(x) * 2) and Counting.calls == 1


GLOBAL_HOOKS = {
    "forward pre-hook": lambda calls: torch_module.register_module_forward_pre_hook(lambda module, args: calls.append(module)),
    "forward hook": lambda calls: torch_module.register_module_forward_hook(lambda module, args, output: calls.append(module)),
    "backward pre-hook": lambda calls: torch_module.register_module_full_backward_pre_hook(lambda module, grad_out: calls.append(module)),
    "backward hook": lambda calls: torch_module.register_module_full_backward_hook(lambda module, grad_in, grad_out: calls.append(module)),
}


@pytest.mark.parametrize("kind", list(GLOBAL_HOOKS))
def test_a_global_module_hook_sees_the_wrapper_too(kind):
    _, model, fmodel, _ = set_up()
    calls: list[nn.Module] = []
    handle = GLOBAL_HOOKS[kind](calls)
    try:
        fmodel(torch.randn(2, 3, requires_grad=True)).sum().backward()
    finally:
        handle.remove()
    assert fmodel in calls and model in calls and len(calls) == 5  # the wrapper, Sequential, Linear, ReLU, Linear
    calls.clear()
    fmodel(torch.randn(2, 3))
    assert calls == []


def test_in_place_compile_of_the_wrapper_is_used():
    _, model, fmodel, _ = set_up()
    compiled_graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        compiled_graphs.append(graph)
        return graph.forward

    fmodel.compile(backend=backend)
    x = torch.randn(2, 3)
    assert torch.allclose(fmodel(x), model(x)) and len(compiled_graphs) == 1


def test_compile_of_the_wrapper_traces_one_graph():
    _, model, fmodel, _ = set_up()
    compiled = torch.compile(fmodel, backend="eager", fullgraph=True)  # a graph break would raise
    x = torch.randn(2, 3)
    assert torch.allclose(compiled(x), model(x))


class Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_records_the_wrapper_as_a_module():
    _, model, fmodel, _ = set_up()
    x = torch.randn(2, 3)
    assert torch.allclose(torch.jit.trace(fmodel, x)(x + 1), model(x + 1))
    traced = torch.jit.trace(Holder(fmodel), x)
    assert torch.allclose(traced(x + 1), model(x + 1))
    scopes = {node.scopeName() for node in traced.inlined_graph.nodes()}
    assert any(scope.startswith("__module.inner/__module.inner._forward_module/") for scope in scopes), scopes


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])
def test_a_converting_precision_still_converts(precision):
    _, model, fmodel, _ = set_up(precision)
    seen = []
    model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    out = fmodel(torch.randn(2, 3))
    assert seen == [torch.float64 if precision == "64-true" else torch.bfloat16] and out.dtype == torch.float32


FLOATING = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("target", FLOATING)
@pytest.mark.parametrize("source", [*FLOATING, torch.int64, torch.complex64])
def test_precision_casts_are_the_casts_of_tensor_to(source, target):
    from fabric.plugins.precision import _cast_tensor

    base = torch.randn(4, 3, 2, 5).to(source)
    tensor = base.to(memory_format=torch.channels_last)  # the memory format must be kept, as .to keeps it
    if source.is_floating_point:
        tensor.requires_grad_(True)
    cast = _cast_tensor(tensor, target)
    if source == target or not source.is_floating_point:
        assert cast is tensor
        return
    expected = tensor.to(target)
    assert cast.dtype == expected.dtype == target and cast.stride() == expected.stride() and torch.equal(cast, expected)
    assert type(cast.grad_fn).__name__ == type(expected.grad_fn).__name__  # differentiable, as .to is


# ---- Fabric.backward and FabricOptimizer.step ---------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "bf16-true"])
def test_plain_precisions_take_the_shortcuts(precision):
    fabric, _, _, foptimizer = set_up(precision)
    assert plain_backward(fabric.strategy) and plain_optimizer_step(fabric.strategy)
    assert fabric._plain_backward and foptimizer._plain_step


def test_a_scaler_or_an_overridden_hook_keeps_the_full_path():
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    assert not scaled.plain_backward and not scaled.plain_optimizer_step

    class Custom(DoublePrecision):
        def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
            return super().optimizer_step(optimizer, **kwargs)

    assert Custom().plain_backward and not Custom().plain_optimizer_step
    assert Precision().plain_backward and MixedPrecision("bf16-mixed", "cpu").plain_optimizer_step


class RecordingPrecision(Precision):
    """Full precision whose backward and step record what they were given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("backward", module))
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        self.calls.append(("step", sorted(kwargs)))
        return super().optimizer_step(optimizer, **kwargs)


def test_a_precision_plugin_with_its_own_backward_and_step_is_called():
    plugin = RecordingPrecision()
    fabric, _model, fmodel, foptimizer = set_up(None, plugins=plugin)
    assert not fabric._plain_backward and not foptimizer._plain_step
    loss = fmodel(torch.randn(4, 3)).sum()
    fabric.backward(loss, model=fmodel)
    foptimizer.step()
    foptimizer.step(closure=lambda: torch.tensor(0.0))
    assert plugin.calls == [("backward", fmodel._forward_module), ("step", []), ("step", ["closure"])]


class RecordingStrategy(SingleDeviceStrategy):
    """A single-device strategy with backward and step of its own (as Horovod's and DDP's have)."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.calls: list[str] = []

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.calls.append("backward")
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        self.calls.append("step")
        return super().optimizer_step(optimizer, **kwargs)


def test_a_strategy_with_its_own_backward_and_step_is_called():
    strategy = RecordingStrategy()
    fabric = Fabric(accelerator="cpu", strategy=strategy)
    model = nn.Linear(3, 1)
    fmodel, foptimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(fmodel(torch.randn(2, 3)).sum())
    foptimizer.step()
    assert strategy.calls == ["backward", "step"]


def test_the_shortcuts_train_exactly_as_the_raw_loop():
    fabric, _, fmodel, foptimizer = set_up()
    torch.manual_seed(0)
    raw = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    raw_optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        raw(x).square().sum().backward(retain_graph=True)
        fabric.backward(fmodel(x).square().sum(), retain_graph=True)  # extra arguments reach torch
        raw_optimizer.step()
        foptimizer.step()
        raw_optimizer.zero_grad()
        foptimizer.zero_grad()
    for (name, mine), theirs in zip(fmodel.named_parameters(), raw.parameters()):
        assert torch.equal(mine, theirs), name


# ---- moving batches that are already on the CPU ------------------------------------------------------------


Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str


class Tagged(torch.Tensor):
    pass


def _full_walk(batch: Any) -> Any:
    """What moving to the CPU gives without any shortcut: ``.to`` on every movable leaf, new containers."""

    def move(obj: Any) -> Any:
        return obj.to(torch.device("cpu"))

    return apply_to_collection(batch, torch.Tensor, move)


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a is b  # a tensor already on the CPU is returned itself, not a copy
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            _same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for left, right in zip(a, b):
            _same(left, right)
    else:
        assert a == b


X, Y = torch.ones(2, 3), torch.arange(4)
BATCHES = {
    "tensor": X,
    "tuple": (X, Y),
    "list": [X, Y],
    "dict": {"x": X, "y": Y},
    "empty tuple": (),
    "empty list": [],
    "float64 and int64 leaves keep their dtypes": (X.double(), Y),
    "non-tensor leaf": (X, 3),
    "string leaf": {"x": X, "name": "a"},
    "nested": {"x": X, "more": [Y, (X, None)]},
    "list of lists": [[X], [Y]],
    "namedtuple": Pair(X, Y),
    "dataclass": Batch(X, "a"),
    "ordered dict": OrderedDict(x=X, y=Y),
    "tensor subclass": (X.as_subclass(Tagged), Y),
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_a_batch_already_on_the_cpu_comes_back_as_from_the_full_walk(name):
    batch = BATCHES[name]
    expected = _full_walk(batch)
    for moved in (move_data_to_device(batch, "cpu"), Fabric(accelerator="cpu", devices=1).to_device(batch)):
        _same(moved, expected)
        if isinstance(batch, (list, dict)) or dataclasses.is_dataclass(batch):
            assert moved is not batch  # a new container: the caller's own stays as it was when the result changes


@pytest.mark.parametrize("name", ["tensor", "tuple", "list", "dict", "nested", "namedtuple", "dataclass", "tensor subclass"])
def test_a_batch_for_another_device_is_moved(name):
    moved = move_data_to_device(BATCHES[name], torch.device("meta"))
    leaves: list[torch.Tensor] = []
    apply_to_collection(moved, torch.Tensor, leaves.append)
    assert leaves and {leaf.device.type for leaf in leaves} == {"meta"}


def test_a_tensor_on_another_device_inside_a_flat_batch_is_moved():
    on_meta = torch.empty(2, device="meta")
    with pytest.raises(NotImplementedError):  # meta tensors have no data: moving one to the CPU is really attempted
        move_data_to_device((X, on_meta), "cpu")
    with pytest.raises(NotImplementedError):
        move_data_to_device({"x": X, "m": on_meta}, torch.device("cpu"))
    fabric = Fabric(accelerator="cpu", devices=1)
    for batch in ((X, on_meta), (on_meta,), [X, on_meta]):
        with pytest.raises(NotImplementedError):
            fabric.to_device(batch)


def test_zero_grad_is_the_optimizers_own_also_when_its_class_overrides_it():
    class CountingSGD(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            self.calls = getattr(self, "calls", 0) + 1
            super().zero_grad(set_to_none=set_to_none)

    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(3, 1)
    fmodel, foptimizer = fabric.setup(model, CountingSGD(model.parameters(), lr=0.1))
    fabric.backward(fmodel(torch.randn(4, 3)).sum())
    foptimizer.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    foptimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters()) and foptimizer.optimizer.calls == 2
    foptimizer.load_state_dict(foptimizer.state_dict())  # the wrapper's shared attributes are refreshed
    foptimizer.zero_grad()
    assert foptimizer.optimizer.calls == 3


def test_set_up_loaders_give_batches_as_before():
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8.0).view(4, 2), torch.arange(4)), batch_size=2))
    batches = list(loader)
    assert [type(batch) for batch in batches] == [list, list]
    assert torch.equal(batches[1][0], torch.tensor([[4.0, 5.0], [6.0, 7.0]])) and torch.equal(batches[1][1], torch.tensor([2, 3]))
    on_meta = FabricDataLoader(DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2), device=torch.device("meta"))
    assert {batch[0].device.type for batch in on_meta} == {"meta"}
