"""The collective of a job with one process: every operation leaves its data as it is."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from fabric.plugins.collectives.collective import Collective
from fabric.utilities.types import CollectibleGroup

__all__ = ["SingleDeviceCollective"]


class _OneRankGroup:
    """A group of this process alone."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class SingleDeviceCollective(Collective):
    """Rank 0 of 1: reductions and broadcasts return the input, gathers give back one entry."""

    @property
    @override
    def rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        return tensor

    @override
    def all_reduce(self, tensor: Tensor, op: Any = "sum") -> Tensor:
        return tensor

    @override
    def reduce(self, tensor: Tensor, dst: int, op: Any = "sum") -> Tensor:
        return tensor

    @override
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]:
        return [tensor]

    @override
    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]:
        return [tensor]

    @override
    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor:
        return scatter_list[0]

    @override
    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: Any = "sum") -> Tensor:
        return input_list[0]

    @override
    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]:
        return input_tensor_list

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        return None

    @override
    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor:
        return tensor

    def all_gather_object(self, object_list: list[Any], obj: Any) -> list[Any]:
        object_list[:1] = [obj]
        return object_list

    def broadcast_object_list(self, object_list: list[Any], src: int, device: Any = None) -> list[Any]:
        return object_list

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0) -> list[Any]:
        return [obj]

    def scatter_object_list(
        self, scatter_object_output_list: list[Any], scatter_object_input_list: list[Any], src: int = 0
    ) -> list[Any]:
        scatter_object_output_list[:1] = scatter_object_input_list[:1]
        return scatter_object_output_list

    @override
    def barrier(self, device_ids: list[int] | None = None) -> None:
        return None

    @classmethod
    @override
    def is_available(cls) -> bool:
        return True

    @classmethod
    @override
    def is_initialized(cls) -> bool:
        return True

    @classmethod
    @override
    def init_group(cls, **kwargs: Any) -> None:
        return None

    @classmethod
    @override
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        return _OneRankGroup()

    @classmethod
    @override
    def destroy_group(cls, group: CollectibleGroup) -> None:
        return None
