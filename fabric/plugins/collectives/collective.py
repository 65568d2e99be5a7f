"""The interface of a collective object: a group of ranks and the operations that run on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor
from typing_extensions import Self

from fabric.utilities.types import CollectibleGroup

__all__ = ["CollectibleGroup", "Collective"]


class Collective(ABC):
    """A group of ranks (made by :meth:`create_group`) and the collectives that run on it.

    ``setup`` joins the job's default group where nothing has yet; ``create_group`` gives this object a
    group of its own (every rank must call it, as torch requires of group creation); ``teardown`` leaves
    that group again. Operations take and return tensors, and fill the lists they are given, as the
    torch.distributed functions behind them do.
    """

    def __init__(self) -> None:
        self._group: CollectibleGroup | None = None

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank inside the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many ranks the group has."""

    @property
    def group(self) -> CollectibleGroup:
        if self._group is None:
            raise RuntimeError(f"{type(self).__name__} has no group yet: call .create_group() on every rank first")
        return self._group

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Tensor: ...

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: Any = "sum") -> Tensor: ...

    @abstractmethod
    def reduce(self, tensor: Tensor, dst: int, op: Any = "sum") -> Tensor: ...

    @abstractmethod
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]: ...

    @abstractmethod
    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]: ...

    @abstractmethod
    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor: ...

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: Any = "sum") -> Tensor: ...

    @abstractmethod
    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]: ...

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None: ...

    @abstractmethod
    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor: ...

    @abstractmethod
    def barrier(self, device_ids: list[int] | None = None) -> None: ...

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this kind of collective can run in this installation."""

    @classmethod
    @abstractmethod
    def is_initialized(cls) -> bool:
        """Whether the job's default group exists in this process."""

    @classmethod
    @abstractmethod
    def init_group(cls, **kwargs: Any) -> None:
        """Join the job's default group."""

    @classmethod
    @abstractmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        """A new group (of ``ranks``, or of every rank); every rank of the job must call it."""

    @classmethod
    @abstractmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        """Leave ``group``."""

    def setup(self, **kwargs: Any) -> Self:
        """Join the default group with ``kwargs`` unless this process is in it already."""
        if not self.is_initialized():
            self.init_group(**kwargs)
        return self

    def create_group(self, **kwargs: Any) -> Self:
        """Give this object a new group of its own (``kwargs`` as for :meth:`new_group`)."""
        if self._group is not None:
            raise RuntimeError(f"{type(self).__name__} already has a group; call .teardown() before creating another")
        self._group = self.new_group(**kwargs)
        return self

    def teardown(self) -> Self:
        """Leave this object's group (the default group is left alone)."""
        if self._group is not None:
            self.destroy_group(self._group)
            self._group = None
        return self
