"""Collectives on ``torch.distributed`` (gloo, nccl, ...), each run on the object's own group."""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any, ClassVar

import torch.distributed as dist
from torch import Tensor
from typing_extensions import Self, override

from fabric.plugins.collectives.collective import Collective
from fabric.utilities.types import CollectibleGroup

__all__ = ["TorchCollective"]

# names accepted for ``op`` besides torch's own ReduceOp members (case does not matter)
_OP_ALIASES = {"mean": "AVG", "prod": "PRODUCT"}


class TorchCollective(Collective):
    """A group of ranks on ``torch.distributed``.

    Without :meth:`create_group`, operations run on the default group (every rank of the job). ``src`` and
    ``dst`` are global ranks, as in ``torch.distributed``. ``op`` is a ``torch.distributed.ReduceOp`` or
    its name ("sum", "product", "min", "max", "band", "bor", "bxor", "avg"; also "mean" and "prod").
    """

    # how many set-up objects rely on a default group that this class created (the last teardown leaves it)
    _default_group_users: ClassVar[int] = 0
    _created_default_group: ClassVar[bool] = False

    def __init__(self) -> None:
        if not dist.is_available():
            raise RuntimeError("TorchCollective needs torch.distributed, which this build of PyTorch lacks")
        super().__init__()
        self._uses_default_group = False

    @property
    @override
    def group(self) -> CollectibleGroup:
        if self._group is not None:
            return self._group
        if not dist.is_initialized():
            raise RuntimeError("TorchCollective has no group: call .setup(backend=...) (and .create_group()) first")
        return dist.GroupMember.WORLD  # type: ignore[return-value]

    @property
    @override
    def rank(self) -> int:
        return dist.get_rank(self.group)  # type: ignore[arg-type]

    @property
    @override
    def world_size(self) -> int:
        return dist.get_world_size(self.group)  # type: ignore[arg-type]

    # ---- tensor collectives -------------------------------------------------------------------------

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        dist.broadcast(tensor, src, group=self.group)  # type: ignore[arg-type]
        return tensor

    @override
    def all_reduce(self, tensor: Tensor, op: Any = "sum") -> Tensor:
        dist.all_reduce(tensor, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    @override
    def reduce(self, tensor: Tensor, dst: int, op: Any = "sum") -> Tensor:
        dist.reduce(tensor, dst, op=self._convert_to_native_op(op), group=self.group)  # type: ignore[arg-type]
        return tensor

    @override
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]:
        dist.all_gather(tensor_list, tensor, group=self.group)
        return tensor_list

    @override
    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]:
        dist.gather(tensor, gather_list, dst, group=self.group)  # type: ignore[arg-type]
        return gather_list

    @override
    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor:
        dist.scatter(tensor, scatter_list, src, group=self.group)  # type: ignore[arg-type]
        return tensor

    @override
    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: Any = "sum") -> Tensor:
        dist.reduce_scatter(output, input_list, op=self._convert_to_native_op(op), group=self.group)
        return output

    @override
    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]:
        dist.all_to_all(output_tensor_list, input_tensor_list, group=self.group)
        return output_tensor_list

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        dist.send(tensor, dst, tag=tag, group=self.group)  # type: ignore[arg-type]

    @override
    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor:
        dist.recv(tensor, src, tag=tag, group=self.group)  # type: ignore[arg-type]
        return tensor

    @override
    def barrier(self, device_ids: list[int] | None = None) -> None:
        if self.group == dist.GroupMember.NON_GROUP_MEMBER:
            return  # torch refuses a barrier from outside the group
        dist.barrier(group=self.group, device_ids=device_ids)  # type: ignore[arg-type]

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier (gloo only) that names the ranks that did not arrive within ``timeout``."""
        dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=wait_all_ranks)  # type: ignore[arg-type]

    # ---- object collectives (pickled) ----------------------------------------------------------------

    def all_gather_object(self, object_list: list[Any], obj: Any) -> list[Any]:
        dist.all_gather_object(object_list, obj, group=self.group)
        return object_list

    def broadcast_object_list(self, object_list: list[Any], src: int, device: Any = None) -> list[Any]:
        dist.broadcast_object_list(object_list, src, group=self.group, device=device)  # type: ignore[arg-type]
        return object_list

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0) -> list[Any] | None:
        dist.gather_object(obj, object_gather_list, dst, group=self.group)  # type: ignore[arg-type]
        return object_gather_list

    def scatter_object_list(
        self, scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None, src: int = 0
    ) -> list[Any]:
        dist.scatter_object_list(scatter_object_output_list, scatter_object_input_list, src, group=self.group)  # type: ignore[arg-type]
        return scatter_object_output_list

    # ---- groups ------------------------------------------------------------------------------------------

    @override
    def setup(self, main_address: str | None = None, main_port: str | int | None = None, **kwargs: Any) -> Self:
        """Join the default group (``kwargs`` for ``init_process_group``, e.g. ``backend="gloo"``) unless joined.

        ``main_address``/``main_port`` override ``MASTER_ADDR``/``MASTER_PORT``; the ranks come from the
        environment (``RANK``, ``WORLD_SIZE``), as ``fabric-torch run`` and torchrun set them.
        """
        if main_address is not None:
            os.environ["MASTER_ADDR"] = str(main_address)
        if main_port is not None:
            os.environ["MASTER_PORT"] = str(main_port)
        if not dist.is_initialized():
            from fabric.utilities.group_lifetime import leave_process_group_at_exit, wait_until_every_rank_has_joined

            self.init_group(**kwargs)
            TorchCollective._created_default_group = True
            # a rank done joining first must not leave (at its exit) while a peer is still joining
            wait_until_every_rank_has_joined()
            # left at exit as fabric's strategies leave theirs: a gloo group alive at shutdown can abort the process

            atexit.register(leave_process_group_at_exit)
        if TorchCollective._created_default_group and not self._uses_default_group:
            self._uses_default_group = True
            TorchCollective._default_group_users += 1
        return self

    @override
    def teardown(self) -> Self:
        """Leave this object's group, and the default group too if this class joined it and no other object uses it."""
        super().teardown()
        if self._uses_default_group:
            self._uses_default_group = False
            TorchCollective._default_group_users -= 1
            if TorchCollective._default_group_users == 0 and dist.is_initialized():
                TorchCollective._created_default_group = False
                dist.destroy_process_group()
        return self

    @classmethod
    @override
    def is_available(cls) -> bool:
        return dist.is_available()

    @classmethod
    @override
    def is_initialized(cls) -> bool:
        return dist.is_available() and dist.is_initialized()

    @classmethod
    @override
    def init_group(cls, **kwargs: Any) -> None:
        dist.init_process_group(**kwargs)

    @classmethod
    @override
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        return dist.new_group(**kwargs)

    @classmethod
    @override
    def destroy_group(cls, group: CollectibleGroup) -> None:
        # a rank outside the group holds a placeholder that torch cannot destroy
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)

    @classmethod
    def _convert_to_native_op(cls, op: Any) -> Any:
        """``op`` as a ``torch.distributed.ReduceOp``; ValueError naming the accepted names otherwise."""
        if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            return op
        if isinstance(op, str):
            name = _OP_ALIASES.get(op.lower(), op.upper())
            native = getattr(dist.ReduceOp, name, None)
            if isinstance(native, dist.ReduceOp.RedOpType):
                return native
        accepted = sorted(name.lower() for name, value in vars(dist.ReduceOp.RedOpType).items() if isinstance(value, dist.ReduceOp.RedOpType))
        raise ValueError(f"op={op!r} is not a reduce operation; accepted: a torch.distributed.ReduceOp or one of {accepted + sorted(_OP_ALIASES)}")
