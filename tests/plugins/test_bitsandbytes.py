"""BitsandbytesPrecision: validation and the missing package without bitsandbytes; with it (0.50 quantizes on the CPU
too), layer replacement, quantization where a layer lives, loading float checkpoints into quantized layers,
materializing meta layers, and a run through Fabric. The CUDA test runs where there is a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.plugins.precision.bitsandbytes import MODES, BitsandbytesPrecision
from fabric.utilities.init import _materialize_meta_tensors

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

FOUR_BIT = ("nf4", "nf4-dq", "fp4", "fp4-dq")


def _bnb():
    return pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'fabric-torch[bitsandbytes]')")


def _dtype(mode: str) -> torch.dtype:
    return torch.float16 if mode.startswith("int8") else torch.bfloat16


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


def _is_quantized(layer: nn.Module, mode: str) -> bool:
    if mode in FOUR_BIT:
        return layer.weight.dtype == torch.uint8 and tuple(layer.weight.shape) != (layer.out_features, layer.in_features)
    if mode == "int8":
        return layer.weight.dtype == torch.int8
    return layer.weight.dtype == torch.float16  # int8-training keeps float16 weights, quantized in each forward


# ---- without bitsandbytes ------------------------------------------------------------------------------


def test_the_names_lightning_programs_import():
    import fabric.plugins
    import fabric.plugins.precision

    assert fabric.plugins.BitsandbytesPrecision is BitsandbytesPrecision
    assert fabric.plugins.precision.BitsandbytesPrecision is BitsandbytesPrecision


def test_an_unknown_mode_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"mode='int4'.*'nf4', 'nf4-dq', 'fp4', 'fp4-dq', 'int8', 'int8-training'"):
        BitsandbytesPrecision("int4")


def test_a_missing_bitsandbytes_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now fails as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=r"needs the `bitsandbytes` package.*pip install bitsandbytes") as raised:
        BitsandbytesPrecision("nf4")
    assert raised.value.name == "bitsandbytes"


@pytest.mark.procs
def test_importing_fabric_and_the_plugin_imports_no_bitsandbytes():
    code = "import sys, fabric, fabric.plugins; fabric.plugins.BitsandbytesPrecision; print('bitsandbytes' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


# ---- with bitsandbytes: the plugin's parts -------------------------------------------------------------


def test_dtype_defaults_and_int8_takes_float16_only():
    _bnb()
    assert BitsandbytesPrecision("int8").dtype == torch.float16
    assert BitsandbytesPrecision("nf4").dtype in (torch.bfloat16, torch.float16)
    with pytest.raises(ValueError, match=r"'int8-training'.*float16"):
        BitsandbytesPrecision("int8-training", dtype=torch.bfloat16)
    assert repr(BitsandbytesPrecision("nf4", torch.bfloat16)) == "BitsandbytesPrecision(mode='nf4', dtype=torch.bfloat16)"


@pytest.mark.parametrize("mode", MODES)
def test_convert_module_replaces_the_linear_layers(mode):
    bnb = _bnb()
    model = _model()
    weight = model[0].weight
    plugin = BitsandbytesPrecision(mode, _dtype(mode))
    assert plugin.convert_module(model) is model
    kind = bnb.nn.Linear4bit if mode in FOUR_BIT else bnb.nn.Linear8bitLt
    assert isinstance(model[0], kind) and isinstance(model[2], kind) and isinstance(model[1], nn.ReLU)
    # the float weight is taken over as it is (no copy) and quantized when setup moves the model to its device
    assert model[0].weight.data_ptr() == weight.data_ptr() and not _is_quantized(model[0], mode)
    if mode in FOUR_BIT:
        assert model[0].compute_dtype == torch.bfloat16
    assert plugin.convert_module(model) is model and isinstance(model[0], kind)  # converted once only


def test_ignore_modules_are_prefixes_and_attention_projections_stay():
    bnb = _bnb()
    model = nn.ModuleDict({"body": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "head": nn.Linear(4, 2), "attn": nn.MultiheadAttention(4, 1)})
    BitsandbytesPrecision("nf4", ignore_modules={"body.1", "hea"}).convert_module(model)
    assert isinstance(model["body"][0], bnb.nn.Linear4bit)
    assert type(model["body"][1]) is nn.Linear and type(model["head"]) is nn.Linear
    assert not isinstance(model["attn"].out_proj, bnb.nn.Linear4bit)  # MultiheadAttention reads its weight directly


def test_a_model_without_linear_layers_is_refused():
    _bnb()
    with pytest.raises(TypeError, match=r"quantizes nn.Linear layers, and Sequential has none"):
        BitsandbytesPrecision("nf4").convert_module(nn.Sequential(nn.ReLU()))


def test_contexts_and_conversions():
    bnb = _bnb()
    plugin = BitsandbytesPrecision("nf4", torch.bfloat16)
    context = plugin.module_init_context()
    assert nn.Linear is torch.nn.modules.linear.Linear and torch.get_default_dtype() == torch.float32  # nothing before `with`
    with context:
        layer = nn.Linear(8, 4)
        assert torch.get_default_dtype() == torch.bfloat16
    assert isinstance(layer, bnb.nn.Linear4bit) and _is_quantized(layer, "nf4")  # made on a device: quantized at once
    assert nn.Linear is torch.nn.modules.linear.Linear and torch.get_default_dtype() == torch.float32
    for context in (plugin.tensor_init_context(), plugin.forward_context()):
        with context:
            assert torch.get_default_dtype() == torch.bfloat16
    converted = plugin.convert_input({"x": torch.ones(2), "n": torch.ones(2, dtype=torch.long)})
    assert converted["x"].dtype == torch.bfloat16 and converted["n"].dtype == torch.long
    assert plugin.convert_output(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"ignore_modules=\{'head'\}.*init_module"):
        BitsandbytesPrecision("nf4", ignore_modules={"head"}).module_init_context()


def test_devices():
    _bnb()
    plugin = BitsandbytesPrecision("nf4")
    plugin.validate_device("cuda")
    plugin.validate_device("cpu")  # bitsandbytes >= 0.46 has a CPU backend
    with pytest.raises(RuntimeError, match=r"runs on CUDA GPUs and the CPU, not on 'mps'"):
        plugin.validate_device("mps")


# ---- with bitsandbytes: runs on the CPU ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_model_set_up_with_fabric_is_quantized_and_close_to_the_float_model(mode):
    _bnb()
    torch.manual_seed(0)
    model, x = _model(), torch.randn(4, 64)
    expected = model(x)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fabric = Fabric(accelerator="cpu", devices=1, plugins=BitsandbytesPrecision(mode, _dtype(mode)))
    quantized = fabric.setup_module(model)
    if mode != "int8-training":  # bitsandbytes' own move keeps that mode's float32 weight as it is
        assert _is_quantized(quantized.module[0], mode)
    out = quantized(x)
    assert out.dtype == torch.float32  # back in the default dtype
    torch.testing.assert_close(out, expected, atol=0.15, rtol=0)

    # built quantized under init_module, then a float checkpoint loaded into it: quantized on load, the same values
    with fabric.init_module():
        fresh = _model()
    assert _is_quantized(fresh[0], mode) and fresh[2].bias.dtype == _dtype(mode)
    assert not fresh.load_state_dict(state).missing_keys
    assert _is_quantized(fresh[0], mode)
    torch.testing.assert_close(fabric.setup_module(fresh)(x), out, atol=1e-2, rtol=0)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_meta_layers_materialize_and_load(mode):
    _bnb()
    torch.manual_seed(0)
    model, x = _model(), torch.randn(4, 64)
    expected, state = model(x), model.state_dict()
    plugin = BitsandbytesPrecision(mode, _dtype(mode))
    with torch.device("meta"):
        meta = _model()
    plugin.convert_module(meta)
    assert meta[0].weight.is_meta
    _materialize_meta_tensors(meta, torch.device("cpu"))
    assert not meta[0].weight.is_meta and _is_quantized(meta[0], mode)
    meta.load_state_dict(state)
    with plugin.forward_context():
        out = meta(plugin.convert_input(x))
    torch.testing.assert_close(out.float(), expected, atol=0.15, rtol=0)

    # a float checkpoint loaded into a meta layer with assign=True: the layer takes the tensor, quantized when moved
    with torch.device("meta"):
        assigned = _model()
    plugin.convert_module(assigned)
    assigned.load_state_dict(state, assign=True)
    assert assigned[0].weight.data_ptr() == state["0.weight"].data_ptr()
    assigned.to("cpu")
    assert _is_quantized(assigned[0], mode)


@pytest.mark.parametrize("mode", FOUR_BIT)
def test_on_the_cpu_evaluating_then_training_and_narrow_layers_work(mode):
    # bitsandbytes' own AVX512-BF16 inference layout (taken at an eval forward) breaks both; the plugin's layers avoid it
    _bnb()
    plugin = BitsandbytesPrecision(mode, torch.bfloat16)
    model = plugin.convert_module(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))).to("cpu")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 8)  # the second layer has 32 inputs, fewer than a block of 64
    model.train()
    model.requires_grad_(False)
    out = model(x.requires_grad_())
    out.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


# ---- with bitsandbytes and a GPU -----------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' CUDA kernels need a GPU")
@pytest.mark.parametrize("mode", MODES)
def test_on_a_gpu_layers_are_quantized_as_they_are_made(mode):
    _bnb()
    torch.manual_seed(0)
    model, x = _model(), torch.randn(4, 64)
    expected, state = model(x), model.state_dict()
    fabric = Fabric(accelerator="cuda", devices=1, plugins=BitsandbytesPrecision(mode, _dtype(mode)))
    with fabric.init_module(empty_init=True):
        quantized = _model()
    assert quantized[0].weight.device.type == "cuda" and _is_quantized(quantized[0], mode)
    quantized = fabric.setup_module(quantized)
    quantized.load_state_dict(state)
    torch.testing.assert_close(quantized(x.cuda()).cpu(), expected, atol=0.15, rtol=0)
