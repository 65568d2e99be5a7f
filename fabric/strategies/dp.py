"""DataParallel: one process drives several devices by splitting each batch inside forward.

Nothing is launched and there is only one rank, so collectives are identities. The batch stays whole
on the root device; ``torch.nn.DataParallel`` scatters it to the other devices in forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import DataParallel, Module

from fabric.strategies.parallel import ParallelStrategy, check_reduce_op
from fabric.strategies.strategy import Strategy


class DataParallelStrategy(ParallelStrategy):
    """``torch.nn.DataParallel`` over ``parallel_devices`` in this single process."""

    requires_launch = False
    moves_batches = True  # batches go to the root device; DataParallel scatters them from there

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
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError("DataParallelStrategy has no parallel_devices yet; the connector sets them")
        return self.parallel_devices[0]

    # one process: the single-process ranks of Strategy, not ParallelStrategy's cluster-environment ranks
    global_rank = Strategy.global_rank
    local_rank = Strategy.local_rank
    node_rank = Strategy.node_rank
    world_size = Strategy.world_size

    @property
    def distributed_sampler_kwargs(self) -> None:
        return None  # every device sees a slice of the same batch: the loader must not be sharded

    def setup_module(self, module: Module) -> DataParallel:
        device_ids = [d.index for d in self.parallel_devices or [] if d.type == "cuda"]
        # on the CPU there are no device ids; DataParallel then simply calls the module
        return DataParallel(module, device_ids=device_ids or None, output_device=device_ids[0] if device_ids else None)

    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return _unwrap_dp(module).state_dict()

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrap_dp(module), state_dict, strict=strict)

    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            check_reduce_op(reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor  # one process: no leading world dimension, like the single-device strategy

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return bool(decision)

    def __repr__(self) -> str:
        return f"DataParallelStrategy(devices={[str(d) for d in self.parallel_devices or []]})"


def _unwrap_dp(module: Module) -> Module:
    return module.module if isinstance(module, DataParallel) else module
