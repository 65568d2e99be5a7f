"""DataParallel: one process drives several devices by splitting each batch inside forward.

Nothing is launched and there is only one rank, so collectives are identities. The batch stays whole
on the root device; ``torch.nn.DataParallel`` scatters it to the other devices in forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import DataParallel, Module
from typing_extensions import override

from fabric.strategies.parallel import ParallelStrategy
from fabric.strategies.single_device import OneProcessCollectives


class DataParallelStrategy(OneProcessCollectives, ParallelStrategy):
    """``torch.nn.DataParallel`` over ``parallel_devices`` in this single process.

    It needs no launch, so it takes no cluster environment and its ranks are the single process's.
    """

    requires_launch = False

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError("DataParallelStrategy has no parallel_devices yet; the connector sets them")
        return self.parallel_devices[0]

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:
        return None  # every device sees a slice of the same batch: the loader must not be sharded

    @override
    def setup_module(self, module: Module) -> DataParallel:
        device_ids = [d.index for d in self.parallel_devices or [] if d.type == "cuda"]
        if not device_ids:
            return _host_data_parallel(module)
        return DataParallel(module, device_ids=device_ids, output_device=device_ids[0])

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return _unwrap_dp(module).state_dict()

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrap_dp(module), state_dict, strict=strict)

    def __repr__(self) -> str:
        return f"DataParallelStrategy(devices={[str(d) for d in self.parallel_devices or []]})"


def _unwrap_dp(module: Module) -> Module:
    return module.module if isinstance(module, DataParallel) else module


def _host_data_parallel(module: Module) -> DataParallel:
    """A DataParallel with no device, which calls the module as it is (what torch builds on a machine without GPUs).

    torch's constructor given no device ids takes every GPU of the machine (and moves the module to the
    first); a job that asked for the CPU must stay there. The object is torch's class itself, as users see it.
    """
    wrapper = DataParallel.__new__(DataParallel)
    Module.__init__(wrapper)
    wrapper.module = module
    wrapper.device_ids = []
    return wrapper
