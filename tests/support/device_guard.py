"""Test-only guard: every torch.distributed collective refuses a tensor off the device its group serves.

NCCL serves only the rank's GPU and refuses a CPU tensor; gloo takes anything, so on a CPU machine a
collective fed a tensor on the wrong device passes and the same code fails on every GPU job. With
``TEST_COLLECTIVE_DEVICE`` set (the device type a gloo group serves here, ``cpu``), each tensor handed
to a collective is checked as NCCL would check it: a gloo group serves that device type, an NCCL group
the current CUDA device. ``TEST_COLLECTIVE_LOG`` (a folder) makes every process append one line per
collective to ``<pid>.log``: ``name world|group devices numels``, so tests can count what was sent.

The tests' ``conftest.py`` turns the guard on for the test process and, through ``sitecustomize`` in
``child_site/`` on ``PYTHONPATH``, for every Python process a test starts. It patches
``torch.distributed`` when that is first imported, so processes that never import torch pay nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

DEVICE_VARIABLE = "TEST_COLLECTIVE_DEVICE"
LOG_VARIABLE = "TEST_COLLECTIVE_LOG"
SITE_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")

# torch.distributed's collectives that take tensors (the object collectives call these with their buffers)
COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)
_C10D = "torch.distributed.distributed_c10d"


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor on a device its process group does not serve."""


def install() -> None:
    """Guard torch.distributed now if it is imported, else as soon as it is (once per process)."""
    if os.environ.get(DEVICE_VARIABLE) is None:
        return
    if _C10D in sys.modules:
        _guard(sys.modules[_C10D].__dict__)
        if "torch.distributed" in sys.modules:
            _guard(sys.modules["torch.distributed"].__dict__)
    elif not any(isinstance(finder, _GuardOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _GuardOnImport())


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Wraps c10d's collectives right after its module runs, before ``torch.distributed`` re-exports them."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            _guard(module.__dict__)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _guard(namespace: dict[str, Any]) -> None:
    folder = os.path.dirname(namespace["__file__"])
    for name in COLLECTIVES:
        function = namespace.get(name)
        if function is not None and not getattr(function, "_device_guarded", False):
            namespace[name] = _guarded(name, function, folder)


# The wrapper's code carries a file name in torch.distributed's folder: its frame sits inside the collective
# call, and fabric's diagnosis of a stuck rank (which skips torch.distributed's frames to name the user's line)
# must read through it as through torch's own frames.
_WRAPPER = """
def collective(*args, **kwargs):
    inspect_call(name, args, kwargs)
    return function(*args, **kwargs)
"""


def _guarded(name: str, function: Callable[..., Any], folder: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"inspect_call": _inspect_call, "name": name, "function": function}
    exec(compile(_WRAPPER, os.path.join(folder, "_test_device_guard.py"), "exec"), namespace)
    collective = functools.wraps(function)(namespace["collective"])
    collective._device_guarded = True  # type: ignore[attr-defined]
    return collective


def _inspect_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    tensors = list(_tensors_in(args, kwargs.values()))
    group = kwargs.get("group")
    _check(name, tensors, group)
    _log(name, tensors, group)


def _tensors_in(*collections: Any) -> Iterator[Any]:
    import torch

    for collection in collections:
        for value in collection:
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from _tensors_in(value)
            elif hasattr(value, "tensor") and isinstance(getattr(value, "tensor", None), torch.Tensor):  # P2POp
                yield value.tensor


def served_devices(group: Any) -> list[str]:
    """The devices ``group`` accepts tensors on, as NCCL and (under the guard) gloo would."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    served = []
    if "gloo" in backend or "mpi" in backend:
        served.append(os.environ.get(DEVICE_VARIABLE) or "cpu")
    if "nccl" in backend and torch.cuda.is_available():
        served.append(f"cuda:{torch.cuda.current_device()}")
    return served


def _check(name: str, tensors: list[Any], group: Any) -> None:
    import torch.distributed as dist

    if not tensors or not dist.is_initialized():
        return
    served = served_devices(group)
    if not served:
        return
    for tensor in tensors:
        device = tensor.device
        if str(device) not in served and device.type not in served:
            raise CollectiveDeviceError(
                f"torch.distributed.{name} got a tensor on {device} (shape {tuple(tensor.shape)}, {tensor.dtype}); its process"
                f" group ({dist.get_backend(group)}) serves {' and '.join(served)} only. NCCL refuses such a tensor: move it to"
                " the strategy's root device first"
            )


def _log(name: str, tensors: list[Any], group: Any) -> None:
    folder = os.environ.get(LOG_VARIABLE)
    if not folder:
        return
    devices = ",".join(sorted({str(t.device) for t in tensors})) or "-"
    numels = ",".join(str(t.numel()) for t in tensors) or "-"
    line = f"{name} {'world' if group is None else 'group'} {devices} {numels}\n"
    with open(os.path.join(folder, f"{os.getpid()}.log"), "a") as file:
        file.write(line)


def logged_calls(folder: str, name: str | None = None) -> list[list[str]]:
    """The collectives logged under ``folder`` by every process (``name`` alone, if given), as split lines."""
    calls = []
    for entry in sorted(os.listdir(folder)):
        if entry.endswith(".log"):
            with open(os.path.join(folder, entry)) as file:
                calls += [line.split() for line in file if line.strip()]
    return [call for call in calls if name is None or call[0] == name]
