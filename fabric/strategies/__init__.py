"""Strategies by name. Adding one is a file plus a line in ``STRATEGY_REGISTRY``.

Entries name their class as "module:Class" and are imported on first use, so ``import fabric`` never
pays for DistributedDataParallel or Horovod.
"""

from __future__ import annotations

import importlib
from typing import Any

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


__all__ = ["STRATEGY_REGISTRY", "strategy_class", *_CLASSES]
