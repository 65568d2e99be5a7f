"""Precision plugins: names and aliases, parameter dtypes, input/output casting, autocast, gradient scaling."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.plugins.precision import (
    PRECISION_VALUES,
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    normalize_precision,
    precision_for,
)

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

CPU_PRECISIONS = ["32-true", "64-true", "bf16-mixed", "16-true", "bf16-true"]
PARAM_DTYPE = {
    "32-true": torch.float32,
    "64-true": torch.float64,
    "bf16-mixed": torch.float32,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "32-true"),
        ("32-true", "32-true"),
        ("64-true", "64-true"),
        ("16-mixed", "16-mixed"),
        ("bf16-mixed", "bf16-mixed"),
        ("16-true", "16-true"),
        ("bf16-true", "bf16-true"),
        (32, "32-true"),
        (64, "64-true"),
        (16, "16-mixed"),
        ("bf16", "bf16-mixed"),
        ("32", "32-true"),
        ("64", "64-true"),
        ("16", "16-mixed"),
    ],
)
def test_names_and_aliases(given, expected):
    assert normalize_precision(given) == expected
    assert expected in PRECISION_VALUES


@pytest.mark.parametrize("bad", ["16-bit", "fp32", 8, True, "BF16", "16-MIXED"])
def test_unknown_names(bad):
    with pytest.raises(ValueError, match="is not supported; accepted: '32-true'"):
        normalize_precision(bad)


@pytest.mark.parametrize(
    ("name", "device", "cls"),
    [
        ("32-true", "cpu", Precision),
        ("64-true", "cpu", DoublePrecision),
        ("16-true", "cpu", HalfPrecision),
        ("bf16-true", "cuda", HalfPrecision),
        ("bf16-mixed", "cpu", MixedPrecision),
        ("16-mixed", "cuda", MixedPrecision),
    ],
)
def test_precision_for(name, device, cls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA GradScaler without CUDA warns and disables itself
        plugin = precision_for(name, device)
    assert type(plugin) is cls and plugin.precision == name
    assert plugin.is_identity == (name == "32-true")
    assert repr(plugin) == f"{cls.__name__}({name!r})"


class Probe(nn.Module):
    """Records what the wrapped forward sees: input dtypes, default dtype and autocast state."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))
        self.seen = {}

    def forward(self, x, indices=None):
        self.seen = {
            "input": x.dtype,
            "indices": None if indices is None else indices.dtype,
            "default": torch.get_default_dtype(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "autocast_dtype": torch.get_autocast_dtype("cpu"),
        }
        out = self.linear(x)
        self.seen["matmul"] = out.dtype
        return {"out": out * self.scale, "indices": indices}


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_setup_converts_parameters_and_casts_inputs_and_outputs(precision):
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup(Probe())
    dtype = PARAM_DTYPE[precision]
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.scale.dtype == dtype
    out = model(torch.randn(2, 4), indices=torch.tensor([1, 2]))
    seen = model.module.seen
    assert out["out"].dtype == torch.float32, "outputs come back in the default dtype"
    assert out["indices"].dtype == torch.int64 and seen["indices"] == torch.int64, "integers are never cast"
    assert torch.get_default_dtype() == torch.float32
    if precision in ("64-true", "16-true", "bf16-true"):
        assert seen["input"] == dtype and seen["default"] == dtype and seen["matmul"] == dtype
    elif precision == "bf16-mixed":  # floating inputs arrive in the autocast dtype, as in Lightning Fabric
        assert seen["input"] == torch.bfloat16 and seen["default"] == torch.float32
    else:
        assert seen["input"] == torch.float32 and seen["default"] == torch.float32
    if precision == "bf16-mixed":
        assert seen["autocast"] and seen["autocast_dtype"] == torch.bfloat16 and seen["matmul"] == torch.bfloat16
    else:
        assert not seen["autocast"]
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_a_training_step_in_every_cpu_precision(precision):
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(16, 4)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert {p.dtype for p in model.parameters()} == {PARAM_DTYPE[precision]}


class WithComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.phase = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
        self.register_buffer("spectrum", torch.tensor([0.5j, 2 + 0j], dtype=torch.complex64))
        self.register_buffer("count", torch.tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (self.phase * self.spectrum).abs()


def test_double_precision_keeps_complex_tensors_complex():
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    model = fabric.setup(WithComplex())
    assert model.linear.weight.dtype == torch.float64
    assert model.phase.dtype == model.spectrum.dtype == torch.complex128  # not float64 without the imaginary part
    assert torch.equal(model.phase.detach(), torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128))
    assert torch.equal(model.spectrum, torch.tensor([0.5j, 2 + 0j], dtype=torch.complex128))
    assert model.count.dtype == torch.int64
    assert model(torch.ones(1, 2)).dtype == torch.float32


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_precision_leaves_complex_tensors_alone(precision):
    model = Fabric(accelerator="cpu", devices=1, precision=precision).setup(WithComplex())
    assert model.phase.dtype == torch.complex64 and model.linear.weight.dtype == PARAM_DTYPE[precision]


def test_sixteen_mixed_on_the_cpu_warns_and_runs_bf16_mixed():
    with pytest.warns(UserWarning, match="precision='16-mixed' is not supported on the CPU.*'bf16-mixed'"):
        fabric = Fabric(accelerator="cpu", devices=1, precision="16-mixed")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed" and plugin.scaler is None
    model = fabric.setup(Probe())
    assert model(torch.randn(2, 4))["out"].dtype == torch.float32
    assert model.module.seen["autocast_dtype"] == torch.bfloat16 and model.module.seen["input"] == torch.bfloat16
    with pytest.warns(UserWarning, match="'bf16-mixed'"):
        assert Fabric(accelerator="cpu", precision=16).strategy.precision.precision == "bf16-mixed"  # the alias


def test_double_precision_converts_nested_inputs():
    plugin = DoublePrecision()
    data = {"a": torch.ones(1), "b": [torch.ones(1, dtype=torch.float16), torch.ones(1, dtype=torch.int32)], "c": "x"}
    out = plugin.convert_input(data)
    assert out["a"].dtype == torch.float64 and out["b"][0].dtype == torch.float64
    assert out["b"][1].dtype == torch.int32 and out["c"] == "x"
    back = plugin.convert_output(out)
    assert back["a"].dtype == torch.float32 and back["b"][1].dtype == torch.int32


def test_init_contexts_use_the_precision_dtype():
    for precision, dtype in (("64-true", torch.float64), ("bf16-true", torch.bfloat16), ("16-true", torch.float16)):
        fabric = Fabric(accelerator="cpu", precision=precision)
        with fabric.init_module():
            layer = nn.Linear(2, 2)
        with fabric.init_tensor():
            tensor = torch.zeros(2)
        assert layer.weight.dtype == dtype and tensor.dtype == dtype
    assert torch.get_default_dtype() == torch.float32


def test_default_dtype_is_restored_when_forward_raises():
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("inside")

    model = Fabric(accelerator="cpu", precision="64-true").setup(Fails())
    with pytest.raises(ValueError, match="inside"):
        model(torch.ones(1))
    assert torch.get_default_dtype() == torch.float32


def test_invalid_plugin_arguments():
    with pytest.raises(ValueError, match=r"HalfPrecision\(precision='32-true'\)"):
        HalfPrecision("32-true")
    with pytest.raises(ValueError, match=r"MixedPrecision\(precision='bf16-true'\)"):
        MixedPrecision("bf16-true", "cpu")
    with pytest.raises(ValueError, match="does not use a gradient scaler"):
        MixedPrecision("bf16-mixed", "cpu", scaler=RecordingScaler())


# ---- gradient scaling (float16 mixed precision) -------------------------------------------------------


def test_sixteen_mixed_builds_a_grad_scaler_only_for_cuda():
    assert MixedPrecision("bf16-mixed", "cuda").scaler is None
    assert MixedPrecision("16-mixed", "cpu").scaler is None
    assert MixedPrecision("bf16-mixed", "cpu").scaler is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA torch warns that it disables the scaler
        plugin = MixedPrecision("16-mixed", "cuda")
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert plugin.scaler.is_enabled() == torch.cuda.is_available()
    given = RecordingScaler()
    assert MixedPrecision("16-mixed", "cuda", scaler=given).scaler is given


class RecordingScaler:
    """Stands in for torch's GradScaler (which needs CUDA): scales by 4 and records every call."""

    factor = 4.0

    def __init__(self, skip_steps: bool = False):
        self.calls = []
        self.skip_steps = skip_steps
        self.loaded = None

    def scale(self, tensor):
        self.calls.append("scale")
        return tensor * self.factor

    def unscale_(self, optimizer):
        self.calls.append("unscale_")
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.factor)

    def step(self, optimizer, **kwargs):
        self.calls.append("step")
        if not self.skip_steps:
            return optimizer.step(**kwargs)
        return None

    def update(self):
        self.calls.append("update")

    def state_dict(self):
        return {"scale": self.factor}

    def load_state_dict(self, state):
        self.loaded = state


def scaled_setup(scaler):
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    fabric = Fabric(accelerator="cpu", plugins=plugin)
    torch.manual_seed(0)
    raw = nn.Linear(3, 1)
    model = nn.Linear(3, 1)
    model.load_state_dict(raw.state_dict())
    fmodel, foptimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return fabric, plugin, raw, fmodel, foptimizer


def test_scaler_scales_backward_and_steps_then_updates():
    scaler = RecordingScaler()
    fabric, _plugin, raw, fmodel, foptimizer = scaled_setup(scaler)
    x = torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        raw_out = raw(x)
    raw_out.float().sum().backward()
    fabric.backward(fmodel(x).sum())
    assert scaler.calls == ["scale"]
    assert torch.allclose(fmodel.weight.grad, 4.0 * raw.weight.grad)
    norm = fabric.clip_gradients(fmodel, foptimizer, max_norm=100.0)
    assert scaler.calls == ["scale", "unscale_"]
    assert torch.allclose(fmodel.weight.grad, raw.weight.grad)
    assert torch.allclose(norm, torch.linalg.vector_norm(torch.cat([raw.weight.grad.flatten(), raw.bias.grad])))
    before = fmodel.weight.detach().clone()
    foptimizer.step()
    assert scaler.calls == ["scale", "unscale_", "step", "update"]
    assert torch.allclose(fmodel.weight, before - 0.1 * raw.weight.grad)
    fabric.clip_gradients(fmodel, foptimizer, clip_val=1.0)
    assert scaler.calls[-1] == "unscale_"


def test_scaler_may_skip_a_step():
    scaler = RecordingScaler(skip_steps=True)
    fabric, _plugin, _raw, fmodel, foptimizer = scaled_setup(scaler)
    fabric.backward(fmodel(torch.randn(2, 3)).sum())
    before = fmodel.weight.detach().clone()
    assert foptimizer.step() is None
    assert torch.equal(fmodel.weight, before)
    assert scaler.calls == ["scale", "step", "update"]


def test_scaler_refuses_a_closure_and_round_trips_its_state():
    scaler = RecordingScaler()
    _fabric, plugin, _raw, fmodel, foptimizer = scaled_setup(scaler)
    with pytest.raises(ValueError, match="cannot step with a closure"):
        foptimizer.step(lambda: fmodel(torch.ones(1, 3)).sum())
    assert plugin.state_dict() == {"scale": 4.0}
    plugin.load_state_dict({"scale": 8.0})
    assert scaler.loaded == {"scale": 8.0}
    plugin.load_state_dict({})
    assert scaler.loaded == {"scale": 8.0}


def test_no_scaler_means_plain_backward_and_step():
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert plugin.state_dict() == {}
    plugin.load_state_dict({"ignored": 1})
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    plugin.backward(layer(torch.ones(1, 2)).sum(), layer)
    plugin.unscale_gradients(optimizer)
    assert torch.equal(layer.weight.grad, torch.ones(1, 2))
    plugin.optimizer_step(optimizer)
