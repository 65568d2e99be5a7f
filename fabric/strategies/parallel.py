"""The multi-rank base: ranks from the cluster environment, sharding arguments, boolean agreement."""

from __future__ import annotations

from abc import ABC
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from fabric._core.env import global_rank
from fabric.strategies.strategy import REDUCE_OPS, ConnectorChoices, Strategy
from fabric.utilities.collective_device import on_collective_device
from fabric.utilities.rank_zero import set_rank_zero_rank


class ParallelStrategy(Strategy, ABC):
    """A strategy over several devices; with ``requires_launch``, each device is driven by its own process.

    The ranks come from the cluster environment. A subclass that runs in this one process
    (``requires_launch = False``) takes no cluster environment and so keeps the single-process ranks.
    """

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

    @override
    def accept_choices(self, choices: ConnectorChoices) -> None:
        super().accept_choices(choices)
        if self.parallel_devices is None:
            self.parallel_devices = choices.parallel_devices
        if self.cluster_environment is None and self.requires_launch:
            self.cluster_environment = choices.cluster_environment
        self.num_nodes = choices.num_nodes
        self._set_world_ranks()

    def _set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size (known once the
        devices and nodes are), so the ranks are right straight after ``Fabric(...)``."""
        if self.cluster_environment is None:
            return
        self.cluster_environment.set_global_rank(global_rank(self.node_rank, self.num_processes, self.local_rank))
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        set_rank_zero_rank(self.global_rank)

    @property
    @override
    def launched_externally(self) -> bool:
        environment = self.cluster_environment
        return environment is not None and environment.creates_processes_externally

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
    @override
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    @override
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment is not None else 0

    @property
    @override
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment is not None else 0

    @property
    @override
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from every rank into [world_size, ...]; gradients flow back with ``sync_grads``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return tensor
        group = group if group is not None else dist.group.WORLD
        tensor = on_collective_device(tensor, self.root_device).contiguous()
        if sync_grads:
            return _AllGatherWithGrad.apply(tensor, group)
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = torch.tensor(int(bool(decision)), device=self.root_device)
        votes = self.all_reduce(votes, reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def reconciliate_processes(self, trace: str) -> None:
        """Hand this rank's failure (``trace``) to the launcher, which diagnoses it and stops the job.

        The supervising process (rank 0 under "popen") asks the other ranks where they are (so a
        collective timeout names the ranks that never arrived) and stops them; a supervised rank
        records the traceback for its supervisor. Without a launcher (torchrun, SLURM) nothing is done.
        """
        if self.launcher is not None:
            self.launcher.on_rank_failure(trace)

    @override
    def on_exception(self, exception: BaseException) -> None:
        import traceback

        self.reconciliate_processes("".join(traceback.format_exception(exception)))

    @override
    def teardown(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the sum of the gradients every rank computed for its slice.

    (torch.distributed.nn.functional.all_gather does the same but is deprecated and warns on every job.)
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        # an all-reduce rather than a reduce-scatter: gloo has no reduce-scatter
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def check_reduce_op(reduce_op: Any) -> None:
    """Raise for a reduce_op that is neither a known name nor a ``torch.distributed.ReduceOp``."""
    import torch.distributed as dist

    if isinstance(reduce_op, str):
        if reduce_op.lower() not in REDUCE_OPS:
            raise ValueError(f"reduce_op={reduce_op!r} is not supported; accepted: {', '.join(map(repr, REDUCE_OPS))} or a ReduceOp")
    elif not isinstance(reduce_op, (dist.ReduceOp, type(dist.ReduceOp.SUM))):
        raise TypeError(f"reduce_op={reduce_op!r} must be a name ({', '.join(map(repr, REDUCE_OPS))}) or a ReduceOp")
