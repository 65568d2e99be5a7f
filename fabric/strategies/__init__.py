"""Strategies by name. Adding one is a file plus a line in ``STRATEGY_REGISTRY``.

Entries name their class as "module:Class" and are imported on first use, so ``import fabric`` never
pays for DistributedDataParallel or Horovod. How a strategy's processes come to exist
(:func:`strategy_launch`) is answered from the registry too, without importing anything: ``fabric run``
asks it before any rank starts.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

STRATEGY_REGISTRY: dict[str, tuple[str, dict[str, Any]]] = {
    "single_device": ("fabric.strategies.single_device:SingleDeviceStrategy", {}),
    "dp": ("fabric.strategies.dp:DataParallelStrategy", {}),
    "ddp": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "popen"}),
    "ddp_spawn": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "spawn"}),
    "ddp_fork": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "fork"}),
    "ddp_notebook": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "fork"}),
    "ddp_forkserver": ("fabric.strategies.ddp:DDPStrategy", {"start_method": "forkserver"}),
    "ddp_find_unused_parameters_true": (
        "fabric.strategies.ddp:DDPStrategy",
        {"start_method": "popen", "find_unused_parameters": True},
    ),
    "ddp_spawn_find_unused_parameters_true": (
        "fabric.strategies.ddp:DDPStrategy",
        {"start_method": "spawn", "find_unused_parameters": True},
    ),
    "horovod": ("fabric.strategies.horovod:HorovodStrategy", {}),
    "fsdp": ("fabric.strategies.fsdp:FSDPStrategy", {}),
    "fsdp_cpu_offload": ("fabric.strategies.fsdp:FSDPStrategy", {"cpu_offload": True}),
}

# Strategies whose processes do not follow from the registry's ``start_method``.
_ONE_PROCESS_PER_NODE = ("single_device", "dp")
_STARTED_BY_HOROVODRUN = ("horovod",)
_STARTS_FROM_A_FUNCTION = ("spawn", "fork", "forkserver")

StrategyLaunch = Literal["per_device", "one_per_node", "from_function", "horovodrun"]


def strategy_launch(name: str) -> StrategyLaunch:
    """How the processes of the registered strategy ``name`` come to exist.

    ``"per_device"``: one process per device, started by re-running the script (or by ``fabric run``,
    torchrun, srun, ...); ``"one_per_node"``: a single process drives the node's devices;
    ``"from_function"``: ``launch(fn)`` starts them from inside the script (spawn, fork);
    ``"horovodrun"``: Horovod's own launcher starts them.
    """
    if name in _ONE_PROCESS_PER_NODE:
        return "one_per_node"
    if name in _STARTED_BY_HOROVODRUN:
        return "horovodrun"
    if STRATEGY_REGISTRY[name][1].get("start_method") in _STARTS_FROM_A_FUNCTION:
        return "from_function"
    return "per_device"


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
}


def strategy_class(name: str) -> tuple[type, dict[str, Any]]:
    """The class and fixed constructor arguments registered under ``name``."""
    path, kwargs = STRATEGY_REGISTRY[name]
    module_name, class_name = path.split(":")
    return getattr(importlib.import_module(module_name), class_name), dict(kwargs)


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'fabric.strategies' has no attribute {name!r}")


__all__ = ["STRATEGY_REGISTRY", "StrategyLaunch", "strategy_class", "strategy_launch", *_CLASSES]
