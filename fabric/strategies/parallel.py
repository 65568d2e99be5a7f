"""The multi-rank base: ranks from the cluster environment, sharding arguments, boolean agreement."""

from __future__ import annotations

from abc import ABC
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from fabric.strategies.strategy import REDUCE_OPS, Strategy


class ParallelStrategy(Strategy, ABC):
    """A strategy with several ranks, each a process placed on one of ``parallel_devices``."""

    requires_launch = True

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self._num_nodes = 1

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment is not None else 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment is not None else 0

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    def is_global_zero(self) -> bool:
        """Rank 0 of the whole job (not of each node)."""
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every rank into [world_size, ...]; gradients flow back with ``sync_grads``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return tensor
        group = group if group is not None else dist.group.WORLD
        if sync_grads:
            from torch.distributed.nn.functional import all_gather as differentiable_all_gather

            return torch.stack(differentiable_all_gather(tensor.contiguous(), group=group))
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = torch.tensor(int(bool(decision)), device=self.root_device)
        votes = self.all_reduce(votes, reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes > 0)

    @contextmanager
    def block_backward_sync(self, module: Any = None) -> Generator[None, None, None]:
        """Keep gradients local in the backward passes inside this block."""
        if self._backward_sync_control is None or module is None:
            yield
            return
        with self._backward_sync_control.no_backward_sync(module, True):
            yield

    def reconciliate_processes(self, trace: str) -> None:
        """Bring the other ranks down after this one failed with ``trace`` (launchers do the work)."""
        launcher = self.launcher
        if launcher is not None and hasattr(launcher, "kill"):
            launcher.kill()

    def on_exception(self, exception: BaseException) -> None:
        import traceback

        self.reconciliate_processes("".join(traceback.format_exception(exception)))

    def teardown(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()


def check_reduce_op(reduce_op: Any) -> None:
    """Raise for a reduce_op that is neither a known name nor a ``torch.distributed.ReduceOp``."""
    import torch.distributed as dist

    if isinstance(reduce_op, str):
        if reduce_op.lower() not in REDUCE_OPS:
            raise ValueError(f"reduce_op={reduce_op!r} is not supported; accepted: {', '.join(map(repr, REDUCE_OPS))} or a ReduceOp")
    elif not isinstance(reduce_op, (dist.ReduceOp, type(dist.ReduceOp.SUM))):
        raise TypeError(f"reduce_op={reduce_op!r} must be a name ({', '.join(map(repr, REDUCE_OPS))}) or a ReduceOp")
