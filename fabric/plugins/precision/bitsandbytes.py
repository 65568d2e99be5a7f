"""Weights quantized by bitsandbytes: ``BitsandbytesPrecision`` swaps a model's ``nn.Linear`` layers for 4-bit or
8-bit ones.

bitsandbytes is optional: it is imported when a plugin is made, never by ``import fabric``. The layer classes are
built at that moment too (they subclass bitsandbytes' own), once per process.

When a layer's weight is quantized: as soon as it lives on a real device. A layer built on a device (under
``fabric.init_module()``) is quantized at once, so a large model never fills the GPU with its float weights; a layer
swapped in by ``convert_module`` keeps the float weight it took over until ``setup`` moves it to the device;
one on the meta device stays unquantized until it is materialized (``to_empty``) or a state dict gives it a weight.
Loading a float state dict into a quantized layer quantizes the incoming weight on the layer's device.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from typing import Any, Literal

import torch

from fabric.plugins.precision import _SingleDtypePrecision, default_dtype

Mode = Literal["nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training"]
MODES: tuple[str, ...] = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")

# taken before any ``module_init_context`` replaces ``torch.nn.Linear`` for the length of a ``with`` block
_TORCH_LINEAR = torch.nn.Linear
# MultiheadAttention reads its output projection's weight directly, so that layer must stay a float Linear
_KEPT_LINEARS: tuple[type, ...] = (torch.nn.modules.linear.NonDynamicallyQuantizableLinear,)


class BitsandbytesPrecision(_SingleDtypePrecision):
    """Quantize every ``nn.Linear`` of the model with `bitsandbytes <https://github.com/bitsandbytes-foundation/bitsandbytes>`_.

    Args:
        mode: ``"nf4"`` / ``"fp4"`` (4-bit NormalFloat / float), with ``"-dq"`` their scales quantized again
            (double quantization, a little less memory); ``"int8"`` (LLM.int8() inference: int8 weights) or
            ``"int8-training"`` (float16 weights, quantized on the fly in each forward).
        dtype: the dtype the layers compute in, and the default dtype under ``init_module``/``init_tensor`` and in
            forward. ``None``: float16 for the int8 modes (the only one they take), otherwise bfloat16 where the GPU
            supports it, else float16.
        ignore_modules: names of submodules whose Linear layers stay as they are (e.g. ``{"lm_head"}``); a name is
            a prefix, so ``"transformer.h"`` keeps every layer under it.

    Initialisation, forward and inputs/outputs follow ``dtype`` as under ``"bf16-true"``/``"16-true"`` (the shared
    single-dtype base); only the module's conversion and ``init_module`` differ.

    The optimizer is not replaced (by an 8-bit one of bitsandbytes): pass one yourself if you want it.
    """

    def __init__(self, mode: Mode, dtype: torch.dtype | None = None, ignore_modules: set[str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"BitsandbytesPrecision(mode={mode!r}) is not a quantization mode; accepted: {', '.join(map(repr, MODES))}")
        bnb = import_bitsandbytes()
        if dtype is None:
            if mode.startswith("int8"):
                dtype = torch.float16
            else:
                dtype = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
        if mode.startswith("int8") and dtype is not torch.float16:
            raise ValueError(f"BitsandbytesPrecision(mode={mode!r}) computes in float16 only; got dtype={dtype}: pass dtype=torch.float16")
        self.mode = mode
        self.dtype = dtype
        self.ignore_modules = set(ignore_modules or ())
        self._linear_cls = layer_classes(bnb)[mode]

    def validate_device(self, device_type: str) -> None:
        if device_type == "cuda" or (device_type == "cpu" and has_cpu_backend()):
            return
        where = "CUDA GPUs and the CPU" if has_cpu_backend() else "CUDA GPUs (this bitsandbytes has no CPU backend)"
        raise RuntimeError(f"BitsandbytesPrecision runs on {where}, not on {device_type!r}")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Replace the Linear layers by quantizing ones (unless the model has some already) and set their compute dtype."""
        if not any(isinstance(m, _TORCH_LINEAR) for m in module.modules()):
            raise TypeError(f"BitsandbytesPrecision quantizes nn.Linear layers, and {type(module).__name__} has none")
        bnb = import_bitsandbytes()
        quantizing = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
        if not any(isinstance(m, quantizing) for m in module.modules()):
            _replace_linears(module, self._linear_cls, self.ignore_modules, quantizing)
        for m in module.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.compute_dtype = self.dtype
                m.compute_type_is_set = False  # bitsandbytes may still pick the input's dtype (float32/bfloat16) at the first call
        return module

    def module_init_context(self) -> AbstractContextManager:
        """Inside: ``torch.nn.Linear`` builds a quantizing layer, and the default dtype is ``dtype``."""
        if self.ignore_modules:
            raise RuntimeError(
                f"BitsandbytesPrecision(ignore_modules={self.ignore_modules}) cannot be combined with init_module(): inside it"
                " every nn.Linear is made quantizing, and the layers to keep would be created on the device in full"
                " precision. Create the model outside init_module(), or drop ignore_modules"
            )
        return _linear_replaced(self._linear_cls, self.dtype)

    def __repr__(self) -> str:
        ignored = f", ignore_modules={self.ignore_modules}" if self.ignore_modules else ""
        return f"{type(self).__name__}(mode={self.mode!r}, dtype={self.dtype}{ignored})"


def import_bitsandbytes() -> ModuleType:
    """The ``bitsandbytes`` module, or a ModuleNotFoundError that says which package to install."""
    try:
        import bitsandbytes
    except ModuleNotFoundError as error:
        if error.name != "bitsandbytes":
            raise
        raise ModuleNotFoundError(
            "BitsandbytesPrecision needs the `bitsandbytes` package, which is not installed: pip install bitsandbytes"
            " (or pip install 'fabric-torch[bitsandbytes]'; from a checkout of fabric: pip install -e '.[bitsandbytes]')",
            name="bitsandbytes",
        ) from None
    return bitsandbytes


def has_cpu_backend() -> bool:
    """Whether the installed bitsandbytes quantizes and multiplies on the CPU (its ``backends.cpu``, 0.46 and later)."""
    import_bitsandbytes()
    return importlib.util.find_spec("bitsandbytes.backends.cpu") is not None


@contextmanager
def _linear_replaced(linear_cls: type, dtype: torch.dtype) -> Generator[None, None, None]:
    with default_dtype(dtype):
        torch.nn.Linear = linear_cls  # type: ignore[misc,assignment]
        try:
            yield
        finally:
            torch.nn.Linear = _TORCH_LINEAR  # type: ignore[misc]


def _replace_linears(module: torch.nn.Module, linear_cls: Any, ignore: set[str], quantizing: tuple[type, ...], prefix: str = "") -> None:
    for name, child in module.named_children():
        path = prefix + name
        if any(path.startswith(kept) for kept in ignore):
            continue
        if isinstance(child, _TORCH_LINEAR) and not isinstance(child, (*_KEPT_LINEARS, *quantizing)):
            setattr(module, name, linear_cls.taking_over(child))
        else:
            _replace_linears(child, linear_cls, ignore, quantizing, prefix=path + ".")


@functools.cache
def layer_classes(bnb: ModuleType) -> dict[str, type]:
    """The quantizing Linear class of every mode (built once: they subclass bitsandbytes' layers)."""

    class _QuantizingLinear:
        """What the 4-bit and 8-bit layers share: building, taking over a Linear, loading, materializing."""

        # attributes of the bitsandbytes layers the methods below use
        weight: Any
        bias: torch.nn.Parameter | None
        in_features: int
        out_features: int

        def _fabric_setup(self, dtype: torch.dtype | None) -> None:
            if dtype is not None:  # nn.Linear's own argument: the float weight (before quantization) and the bias
                self.weight.data = self.weight.data.to(dtype)
                if self.bias is not None:
                    self.bias.data = self.bias.data.to(dtype)
            if not self.weight.is_meta:
                self.weight = self._fresh_weight(self.weight.data, quantize=True)
            self._fabric_ready = True

        @classmethod
        def taking_over(cls, linear: torch.nn.Linear) -> Any:
            """A layer of this class holding ``linear``'s float weight and bias (no copy); quantized when moved to a device."""
            make: Any = cls  # a bitsandbytes layer class with nn.Linear's arguments
            layer = make(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
            layer.weight = layer._fresh_weight(linear.weight.data, quantize=False)
            if linear.bias is not None:
                layer.bias = torch.nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
            layer.train(linear.training)
            return layer

        def is_quantized(self) -> bool:
            raise NotImplementedError

        def _fresh_weight(self, data: torch.Tensor, quantize: bool) -> Any:
            raise NotImplementedError

        def _float_dtype(self) -> torch.dtype:
            return self.weight.dtype if self.weight.is_floating_point() else torch.float16

        def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool, missing_keys: list[str], *rest: Any) -> None:
            key = prefix + "weight"
            incoming = state_dict.get(key)
            takes = (
                isinstance(incoming, torch.Tensor)
                and incoming.is_floating_point()
                and tuple(incoming.shape) == (self.out_features, self.in_features)
                and (self.weight.is_meta or self.is_quantized())
            )
            if not takes:
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *rest)  # type: ignore[misc]
                return
            with torch.no_grad():
                if self.weight.is_meta:  # nowhere to quantize yet: keep the float weight (it is quantized when materialized)
                    self.weight = self._fresh_weight(incoming.detach(), quantize=False)
                else:
                    self.weight = self._fresh_weight(incoming.detach().to(self.weight.device), quantize=True)
            # the other entries (the bias) load as usual; the weight is hidden meanwhile and not reported missing
            del state_dict[key]
            try:
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *rest)  # type: ignore[misc]
            finally:
                state_dict[key] = incoming
            if key in missing_keys:
                missing_keys.remove(key)

        def to_empty(self, *, device: Any, recurse: bool = True) -> Any:
            """Uninitialized tensors on ``device`` that keep the quantization settings (quantized, unless on meta)."""
            device = torch.device(device)
            weight = torch.empty(self.out_features, self.in_features, device=device, dtype=self._float_dtype())
            self.weight = self._fresh_weight(weight, quantize=device.type != "meta")
            if self.bias is not None:
                self.bias = torch.nn.Parameter(torch.empty_like(self.bias, device=device), requires_grad=self.bias.requires_grad)
            return self

        def reset_parameters(self) -> None:
            """nn.Linear's initialization, on a float weight that is then quantized where the layer lives."""
            if not getattr(self, "_fabric_ready", False):  # called by nn.Linear.__init__, before the weight became bitsandbytes'
                _TORCH_LINEAR.reset_parameters(self)  # type: ignore[arg-type]
                return
            device = self.weight.device
            weight = torch.empty(self.out_features, self.in_features, device=device, dtype=self._float_dtype())
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear.reset_parameters
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                torch.nn.init.uniform_(self.bias, -bound, bound)
            self.weight = self._fresh_weight(weight, quantize=device.type != "meta")

    linear_4bit: Any = bnb.nn.Linear4bit
    linear_8bit: Any = bnb.nn.Linear8bitLt

    class _Linear4bit(_QuantizingLinear, linear_4bit):
        _fabric_quant_type: str
        _fabric_double_quant: bool

        def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: torch.dtype | None = None) -> None:
            super().__init__(
                in_features, out_features, bias=bias, compress_statistics=self._fabric_double_quant, quant_type=self._fabric_quant_type, device=device
            )
            # bitsandbytes 0.50 repacks the weight for AVX512-BF16 CPUs at the first forward in eval mode, and that layout
            # breaks a later training forward (an in-place add on a result that needs grad) and any layer with fewer
            # than 64 inputs; the general CPU path is slower for inference but right in both
            self.support_avx512bf16_for_cpu = False
            self._fabric_setup(dtype)

        def is_quantized(self) -> bool:
            return bool(getattr(self.weight, "bnb_quantized", False))

        def _float_dtype(self) -> torch.dtype:
            state = getattr(self.weight, "quant_state", None)
            return state.dtype if self.is_quantized() and state is not None else super()._float_dtype()

        def _fresh_weight(self, data: torch.Tensor, quantize: bool) -> Any:
            settings = {"compress_statistics": self._fabric_double_quant, "quant_type": self._fabric_quant_type, "quant_storage": self.quant_storage}
            weight = bnb.nn.Params4bit(data, requires_grad=False, module=self, **settings)
            if not quantize:
                return weight
            packed, state = bnb.functional.quantize_4bit(data.contiguous(), blocksize=weight.blocksize, **settings)
            self.quant_state = state
            return bnb.nn.Params4bit(
                packed, requires_grad=False, quant_state=state, blocksize=weight.blocksize, module=self, bnb_quantized=True, **settings
            )

    class _Linear8bit(_QuantizingLinear, linear_8bit):
        _fabric_fp16_weights: bool

        def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: torch.dtype | None = None) -> None:
            super().__init__(in_features, out_features, bias=bias, has_fp16_weights=self._fabric_fp16_weights, threshold=6.0, device=device)
            self._fabric_setup(dtype)

        def is_quantized(self) -> bool:
            return self.weight.dtype == torch.int8

        def _fresh_weight(self, data: torch.Tensor, quantize: bool) -> Any:
            if not quantize:
                return bnb.nn.Int8Params(data, requires_grad=self._fabric_fp16_weights, has_fp16_weights=self._fabric_fp16_weights)
            half = data.to(torch.float16).contiguous()
            if self._fabric_fp16_weights:  # "int8-training": float16 weights, quantized in each forward
                return bnb.nn.Int8Params(half, requires_grad=True, has_fp16_weights=True)
            quantized, scales, _ = bnb.functional.int8_vectorwise_quant(half)
            weight = bnb.nn.Int8Params(quantized, requires_grad=False, has_fp16_weights=False)
            weight.CB, weight.SCB = quantized, scales
            return weight

    def mode_class(name: str, base: type, **settings: Any) -> type:
        attributes = {f"_fabric_{key}": value for key, value in settings.items()}
        return type(name, (base,), {"__module__": __name__, "__qualname__": name, **attributes})

    return {
        "nf4": mode_class("NF4Linear", _Linear4bit, quant_type="nf4", double_quant=False),
        "nf4-dq": mode_class("NF4DQLinear", _Linear4bit, quant_type="nf4", double_quant=True),
        "fp4": mode_class("FP4Linear", _Linear4bit, quant_type="fp4", double_quant=False),
        "fp4-dq": mode_class("FP4DQLinear", _Linear4bit, quant_type="fp4", double_quant=True),
        "int8": mode_class("Int8InferenceLinear", _Linear8bit, fp16_weights=False),
        "int8-training": mode_class("Int8TrainingLinear", _Linear8bit, fp16_weights=True),
    }


# the layer classes by name, so that pickle finds a whole model's layers in a new process
_CLASS_NAMES = {
    "NF4Linear": "nf4",
    "NF4DQLinear": "nf4-dq",
    "FP4Linear": "fp4",
    "FP4DQLinear": "fp4-dq",
    "Int8InferenceLinear": "int8",
    "Int8TrainingLinear": "int8-training",
}


def __getattr__(name: str) -> Any:
    if name in _CLASS_NAMES:
        return layer_classes(import_bitsandbytes())[_CLASS_NAMES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MODES", "BitsandbytesPrecision", "import_bitsandbytes"]
