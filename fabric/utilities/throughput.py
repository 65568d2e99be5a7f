"""Training throughput (batches, samples, items and FLOPs per second, and MFU), with Lightning Fabric's names.

``Throughput`` turns running totals (elapsed time, batches, samples, ...) into rates over a window of the
most recent updates; ``ThroughputMonitor`` does the same for a ``Fabric`` and logs the rates to its
loggers. ``measure_flops`` counts the FLOPs of a forward (and backward) pass with
``torch.utils.flop_counter``, ideally on a model built on the meta device, so nothing is computed.
``get_available_flops`` is the device's peak FLOPs for a dtype, for the model FLOPs utilization (MFU).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fabric.utilities.rank_zero import rank_zero_only, rank_zero_warn


class FabricLike(Protocol):
    """What ``ThroughputMonitor`` uses of a ``fabric.Fabric`` (named here so that utilities import no facade)."""

    @property
    def strategy(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def world_size(self) -> int: ...

    def log_dict(self, metrics: Any, step: int | None = None) -> None: ...

__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops"]


class _IncreasingWindow(deque):
    """The last ``maxlen`` values of a running total, which must strictly increase (a stalled timer is a bug)."""

    def append(self, value: Any) -> None:
        if self and value <= self[-1]:
            raise ValueError(f"Expected each value to be larger than the one before: got {value} after {self[-1]}")
        super().append(value)


class Throughput:
    """Rates over the last ``window_size`` updates of running totals.

    ``compute()`` returns the totals (``time``, ``batches``, ``samples``, ``lengths``) and, once the window is
    full, ``device/batches_per_sec``, ``device/samples_per_sec``, ``device/items_per_sec`` (with lengths),
    ``device/flops_per_sec`` (with flops) and ``device/mfu`` (with ``available_flops``); with a world size
    above 1 also the whole job's ``batches_per_sec``, ``samples_per_sec``, ``items_per_sec``, ``flops_per_sec``.

    Args:
        available_flops: the peak FLOPs of one device (for ``device/mfu``).
        world_size: the number of devices; the job's rates are the device's times this.
        window_size: how many updates the rates are averaged over (at least 2).
        separator: between ``device`` and the metric's name.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an int >= 1")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size={window_size!r} must be an int >= 2 (a rate needs two updates)")
        self.available_flops = available_flops
        self.world_size = world_size
        self.separator = separator
        self._time: _IncreasingWindow = _IncreasingWindow(maxlen=window_size)
        self._batches: _IncreasingWindow = _IncreasingWindow(maxlen=window_size)
        self._samples: _IncreasingWindow = _IncreasingWindow(maxlen=window_size)
        self._lengths: _IncreasingWindow = _IncreasingWindow(maxlen=window_size)
        self._flops: deque = deque(maxlen=window_size)  # per update, not a running total

    def update(self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: int | None = None) -> None:
        """Record the totals so far on this device.

        Args:
            time: seconds elapsed since the start (increasing).
            batches: batches processed so far (increasing).
            samples: samples processed so far (>= batches).
            lengths: items (e.g. tokens) processed so far (>= samples).
            flops: FLOPs this device ran since the previous update (e.g. ``measure_flops(...)`` x batches).
        """
        if samples < batches:
            raise ValueError(f"samples={samples} must be >= batches={batches} (a batch holds at least one sample)")
        if lengths is not None and lengths < samples:
            raise ValueError(f"lengths={lengths} must be >= samples={samples} (a sample holds at least one item)")
        if lengths is not None and len(self._lengths) != len(self._samples):
            raise RuntimeError("lengths must be passed to every update() or to none")
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
        if flops is not None:
            self._flops.append(flops * self.world_size)  # the whole job's, assuming every device does the same

    def compute(self) -> dict[str, int | float]:
        """The totals, and the rates once the window is full."""
        if not self._time:
            return {}
        sep = self.separator
        metrics: dict[str, int | float] = {"time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1]}
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        job = self.world_size > 1
        full = len(self._time) == self._time.maxlen
        seconds = self._time[-1] - self._time[0]
        if full:
            rates = {"batches_per_sec": self._batches, "samples_per_sec": self._samples}
            if len(self._lengths) == self._lengths.maxlen:
                rates["items_per_sec"] = self._lengths
            for name, window in rates.items():
                per_device = (window[-1] - window[0]) / seconds
                metrics[f"device{sep}{name}"] = per_device
                if job:
                    metrics[name] = per_device * self.world_size
        if len(self._flops) == self._flops.maxlen and full:
            # the FLOPs of the updates after the window's first one ran in ``seconds``
            job_flops_per_sec = (sum(self._flops) - self._flops[0]) / seconds
            device_flops_per_sec = job_flops_per_sec / self.world_size
            if job:
                metrics["flops_per_sec"] = job_flops_per_sec
            metrics[f"device{sep}flops_per_sec"] = device_flops_per_sec
            if self.available_flops:
                metrics[f"device{sep}mfu"] = device_flops_per_sec / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


class ThroughputMonitor(Throughput):
    """``Throughput`` for a ``Fabric``: its world size, its device's peak FLOPs, and logging to its loggers.

    Only global rank 0 records and logs (the other ranks get ``{}`` from ``compute``). ``compute_and_log``
    logs at ``step`` or, without one, at one more than the last step it logged.
    """

    def __init__(self, fabric: FabricLike, **kwargs: Any) -> None:
        dtype = compute_dtype(fabric.strategy.precision)
        super().__init__(available_flops=get_available_flops(fabric.device, dtype), world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        self.step = -1
        self.update = rank_zero_only(self.update)  # type: ignore[method-assign]
        self.compute = rank_zero_only(self.compute, default={})  # type: ignore[method-assign]
        self.compute_and_log = rank_zero_only(self.compute_and_log, default={})  # type: ignore[method-assign]
        self.reset = rank_zero_only(self.reset)  # type: ignore[method-assign]

    def compute_and_log(self, step: int | None = None, **kwargs: Any) -> dict[str, int | float]:
        self.step = self.step + 1 if step is None else step
        metrics = self.compute(**kwargs)
        self._fabric.log_dict(metrics=metrics, step=self.step)
        return metrics


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """The FLOPs of ``forward_fn()`` (and, with ``loss_fn``, of the loss and the backward pass).

    Build the model and its input on the meta device (``with torch.device("meta"): ...``) to count
    without computing or allocating anything.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    return counter.get_total_flops()


def compute_dtype(precision: Any) -> torch.dtype:
    """The dtype a precision plugin computes matrix products in."""
    dtype = getattr(precision, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# Peak dense FLOPs per second (no sparsity) from the vendors' data sheets, by chip and dtype. "tf32" is
# float32 matmuls on tensor cores, which torch uses unless float32_matmul_precision is "highest".
_TF32 = "tf32"
_GPU_FLOPS: dict[str, dict[Any, float]] = {
    "h200": {torch.float64: 34e12, torch.float32: 67e12, _TF32: 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.int8: 1978.9e12},
    "h100 sxm": {torch.float64: 33.5e12, torch.float32: 66.9e12, _TF32: 494.7e12, torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.int8: 1978.9e12},
    "h100 pcie": {torch.float64: 25.6e12, torch.float32: 51.2e12, _TF32: 378e12, torch.bfloat16: 756e12, torch.float16: 756e12, torch.int8: 1513e12},
    "h100 nvl": {torch.float64: 30e12, torch.float32: 60e12, _TF32: 417.5e12, torch.bfloat16: 835e12, torch.float16: 835e12, torch.int8: 1670e12},
    "a100": {torch.float64: 9.7e12, torch.float32: 19.5e12, _TF32: 156e12, torch.bfloat16: 312e12, torch.float16: 312e12, torch.int8: 624e12},
    "a10g": {torch.float32: 31.2e12, _TF32: 31.2e12, torch.bfloat16: 125e12, torch.float16: 125e12, torch.int8: 250e12},
    "l40s": {torch.float32: 91.6e12, _TF32: 183e12, torch.bfloat16: 362e12, torch.float16: 362e12, torch.int8: 733e12},
    "l4": {torch.float32: 30.3e12, _TF32: 60e12, torch.bfloat16: 121e12, torch.float16: 121e12, torch.int8: 242e12},
    "v100": {torch.float64: 7.8e12, torch.float32: 15.7e12, torch.float16: 125e12},
    "t4": {torch.float32: 8.1e12, torch.float16: 65e12, torch.int8: 130e12},
    "rtx 4090": {torch.float32: 82.6e12, _TF32: 82.6e12, torch.bfloat16: 165.2e12, torch.float16: 165.2e12, torch.int8: 660.6e12},
    "rtx 3090": {torch.float32: 35.6e12, _TF32: 35.6e12, torch.bfloat16: 71e12, torch.float16: 71e12, torch.int8: 284e12},
}


def _chip(device_name: str) -> str | None:
    """The ``_GPU_FLOPS`` key for a CUDA device name such as "NVIDIA H100 80GB HBM3"."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        if "nvl" in name:
            return "h100 nvl"
        return "h100 pcie" if ("pcie" in name or "hbm2e" in name) else "h100 sxm"
    for key in ("a100", "a10g", "l40s", "v100", "t4", "rtx 4090", "rtx 3090"):
        if key in name:
            return key
    if "l4" in name.split():
        return "l4"
    return None


def get_available_flops(device: torch.device, dtype: torch.dtype | str) -> int | None:
    """The peak FLOPs per second of ``device`` computing in ``dtype``, or None (with a warning) when unknown.

    An upper bound only large matrix products come near; the CPU has none here.
    """
    if device.type != "cuda":
        return None
    device_name = torch.cuda.get_device_name(device)
    chip = _chip(device_name)
    if chip is None:
        rank_zero_warn(f"get_available_flops: no FLOPs figure for {device_name!r}")
        return None
    figures = _GPU_FLOPS[chip]
    if dtype is torch.float32 and _TF32 in figures and torch.get_float32_matmul_precision() != "highest":
        dtype = _TF32
    if dtype not in figures:
        rank_zero_warn(f"get_available_flops: {device_name!r} has no FLOPs figure for {dtype}")
        return None
    return int(figures[dtype])
