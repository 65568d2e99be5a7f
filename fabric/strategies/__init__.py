"""Strategies by name. Adding one is a file plus a line in ``STRATEGY_REGISTRY``.

Entries name their class as "module:Class" and are imported on first use, so ``import fabric`` never
pays for DistributedDataParallel or Horovod. How a strategy's processes come to exist
(:func:`strategy_launch`) is answered from the registry too, without importing anything: ``fabric run``
asks it before any rank starts.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from fabric._core.lazy import submodule

StrategyLaunch = Literal["per_device", "one_per_node", "from_function", "horovodrun"]

#: name -> ("module:Class", fixed constructor arguments, how its processes come to exist). The last field is
#: the one source of that fact for ``fabric run``, which may not import the classes; a test checks that each
#: class declares the same (``requires_launch``, ``start_method``).
STRATEGY_REGISTRY: dict[str, tuple[str, dict[str, Any], StrategyLaunch]] = {
    "single_device": ("fabric.strategies.single_device:SingleDeviceStrategy", {}, "one_per_node"),
    "dp": ("fabric.strategies.dp:DataParallelStrategy", {}, "one_per_node"),
    "ddp": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "popen"}, "per_device"),
    "ddp_spawn": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "spawn"}, "from_function"),
    "ddp_fork": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "fork"}, "from_function"),
    "ddp_notebook": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "fork"}, "from_function"),
    "ddp_forkserver": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "forkserver"}, "from_function"),
    "ddp_find_unused_parameters_true": (
        "fabric.strategies.ddp:DDPStrategy",
        {"start_method": "popen", "find_unused_parameters": True},
        "per_device",
    ),
    "ddp_spawn_find_unused_parameters_true": (
        "fabric.strategies.ddp:DDPStrategy",
        {"start_method": "spawn", "find_unused_parameters": True},
        "from_function",
    ),
    "horovod": ("fabric.strategies.horovod:HorovodStrategy", {}, "horovodrun"),
    "fsdp": ("fabric.strategies.fsdp:FSDPStrategy", {}, "per_device"),
    "fsdp_cpu_offload": ("fabric.strategies.fsdp:FSDPStrategy", {"cpu_offload": True}, "per_device"),
    "ddp_ft": ("fabric.strategies.fault_tolerant:FaultTolerantStrategy", {}, "per_device"),
    "hsdp_ft": ("fabric.strategies.fault_tolerant:HSDPFaultTolerantStrategy", {}, "per_device"),
}


def strategy_launch(name: str) -> StrategyLaunch:
    """How the processes of the registered strategy ``name`` come to exist.

    ``"per_device"``: one process per device, started by re-running the script (or by ``fabric run``,
    torchrun, srun, ...); ``"one_per_node"``: a single process drives the node's devices;
    ``"from_function"``: ``launch(fn)`` starts them from inside the script (spawn, fork);
    ``"horovodrun"``: Horovod's own launcher starts them.
    """
    return STRATEGY_REGISTRY[name][2]


_CLASSES = {
    "Strategy": "fabric.strategies.strategy",
    "BackwardSyncControl": "fabric.strategies.strategy",
    "SingleDeviceStrategy": "fabric.strategies.single_device",
    "ParallelStrategy": "fabric.strategies.parallel",
    "ProcessGroupStrategy": "fabric.strategies.ddp",
    "DDPStrategy": "fabric.strategies.ddp",
    "DataParallelStrategy": "fabric.strategies.dp",
    "HorovodStrategy": "fabric.strategies.horovod",
    "FSDPStrategy": "fabric.strategies.fsdp",
    "ModelParallelStrategy": "fabric.strategies.model_parallel",
    "FaultTolerantStrategy": "fabric.strategies.fault_tolerant",
    "HSDPFaultTolerantStrategy": "fabric.strategies.fault_tolerant",
}


def strategy_class(name: str) -> tuple[type, dict[str, Any]]:
    """The class and fixed constructor arguments registered under ``name``."""
    path, kwargs, _ = STRATEGY_REGISTRY[name]
    module_name, class_name = path.split(":")
    return getattr(importlib.import_module(module_name), class_name), dict(kwargs)


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    return submodule(__name__, name)  # a submodule, e.g. fabric.strategies.fsdp


__all__ = ["STRATEGY_REGISTRY", "StrategyLaunch", "strategy_class", "strategy_launch", *_CLASSES]
