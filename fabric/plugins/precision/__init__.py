"""Numeric precision: how parameters are stored, how forward runs (autocast or not), how backward/step scale.

One class per family, each small: ``Precision`` (true precision of the default dtype, the fast path:
no casting at all), ``DoublePrecision`` / ``HalfPrecision`` (parameters and inputs in one dtype),
``MixedPrecision`` (autocast, with a gradient scaler for float16 on CUDA), and in ``bitsandbytes.py``
``BitsandbytesPrecision`` (quantized Linear layers; bitsandbytes is imported only when one is made).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from fabric._core.lazy import lazy_attributes

# re-exported: the names live in the torch-free core, where `fabric run` reads them too
from fabric._core.names import PRECISION_ALIASES as PRECISION_ALIASES
from fabric._core.names import PRECISION_VALUES as PRECISION_VALUES
from fabric._core.names import normalize_precision as normalize_precision


@contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """Make ``dtype`` torch's default floating dtype inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# the same casts as ``tensor.to(dtype)``, with less argument parsing: a third less work per call
_CASTS = {torch.float32: torch.Tensor.float, torch.float64: torch.Tensor.double, torch.bfloat16: torch.Tensor.bfloat16, torch.float16: torch.Tensor.half}


def _cast_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.dtype == dtype or not tensor.is_floating_point():
        return tensor
    cast = _CASTS.get(dtype)
    return tensor.to(dtype) if cast is None else cast(tensor)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):  # the common case, without the collection walk
        return _cast_tensor(data, dtype)
    return apply_to_collection(data, torch.Tensor, _cast_tensor, dtype)


class Precision:
    """Full precision in torch's default dtype (``"32-true"``): every hook is a no-op, so it costs nothing."""

    precision: str = "32-true"

    def validate_device(self, device_type: str) -> None:
        """Raise if this precision cannot run on ``device_type`` ("cpu", "cuda", "mps"); the connector asks once."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def module_init_context(self) -> AbstractContextManager:
        return nullcontext()

    def tensor_init_context(self) -> AbstractContextManager:
        return nullcontext()

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        return data

    def convert_output(self, data: Any) -> Any:
        return data

    @property
    def is_identity(self) -> bool:
        """True when forward needs no input/output conversion and no context (the wrapper's fast path)."""
        return type(self) is Precision

    @property
    def plain_backward(self) -> bool:
        """True when ``backward`` is just ``tensor.backward(...)``: ``Fabric.backward`` may then call it directly."""
        return type(self).backward is Precision.backward

    @property
    def plain_optimizer_step(self) -> bool:
        """True when ``optimizer_step`` is just ``optimizer.step(...)``: the wrapped optimizer may then call it."""
        return type(self).optimizer_step is Precision.optimizer_step

    def backward(self, tensor: torch.Tensor, module: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        return optimizer.step(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale before clipping (only scalers change anything)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def teardown(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"


class _SingleDtypePrecision(Precision):
    """Parameters, buffers and floating inputs all in one dtype; outputs back in the default dtype."""

    dtype: torch.dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # not ``module.to(dtype)``: that would cast complex tensors to a real dtype, dropping their imaginary part
        complex_dtype = _COMPLEX_OF.get(self.dtype)

        def convert(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.is_floating_point():
                return tensor.to(self.dtype)
            if tensor.is_complex() and complex_dtype is not None:
                return tensor.to(complex_dtype)
            return tensor

        return module._apply(convert)

    def module_init_context(self) -> AbstractContextManager:
        return default_dtype(self.dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return default_dtype(self.dtype)

    def forward_context(self) -> AbstractContextManager:
        return default_dtype(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())


# the complex dtype of the same precision; half precisions leave complex tensors as they are
_COMPLEX_OF = {torch.float64: torch.complex128}


class DoublePrecision(_SingleDtypePrecision):
    """``"64-true"``: everything in float64, and complex tensors in complex128."""

    precision = "64-true"
    dtype = torch.float64


class HalfPrecision(_SingleDtypePrecision):
    """``"16-true"`` / ``"bf16-true"``: parameters and activations in float16 or bfloat16."""

    def __init__(self, precision: str = "bf16-true") -> None:
        if precision not in ("16-true", "bf16-true"):
            raise ValueError(f"HalfPrecision(precision={precision!r}); accepted: '16-true', 'bf16-true'")
        self.precision = precision
        self.dtype = torch.float16 if precision == "16-true" else torch.bfloat16


class MixedPrecision(Precision):
    """``"16-mixed"`` / ``"bf16-mixed"``: float32 parameters, forward under ``torch.autocast``.

    float16 on CUDA needs a gradient scaler so small gradients do not underflow; bfloat16 does not.
    """

    def __init__(self, precision: str, device: str, scaler: Any | None = None) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"MixedPrecision(precision={precision!r}); accepted: '16-mixed', 'bf16-mixed'")
        self.precision = precision
        self.device = device
        self.dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        if scaler is None and precision == "16-mixed" and device == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError("precision='bf16-mixed' does not use a gradient scaler; pass scaler=None")
        self.scaler = scaler

    def forward_context(self) -> AbstractContextManager:
        return torch.autocast(self.device, dtype=self.dtype)

    def convert_input(self, data: Any) -> Any:
        # as Lightning Fabric does: floating inputs arrive in the autocast dtype
        return _cast_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())

    @property
    def plain_backward(self) -> bool:
        return self.scaler is None and type(self).backward is MixedPrecision.backward

    @property
    def plain_optimizer_step(self) -> bool:
        return self.scaler is None and type(self).optimizer_step is MixedPrecision.optimizer_step

    def backward(self, tensor: torch.Tensor, module: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if "closure" in kwargs:
            raise ValueError("precision='16-mixed' with a gradient scaler cannot step with a closure")
        result = self.scaler.step(optimizer, **kwargs)  # skips the step when gradients overflowed
        self.scaler.update()
        return result

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def precision_for(precision: str, device_type: str) -> Precision:
    """The plugin for a normalized precision string on a device type ("cpu", "cuda", "mps")."""
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)
    return MixedPrecision(precision, device_type)


# Lightning's path for it; resolved by name, as fabric.plugins does: its module imports this one
__getattr__ = lazy_attributes(__name__, {"BitsandbytesPrecision": "fabric.plugins.precision.bitsandbytes"})
