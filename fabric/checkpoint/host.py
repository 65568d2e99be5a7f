"""What the checkpoint wing needs of a strategy (:class:`CheckpointHost`), so that nothing in it imports one; and the
agreement of a load walk over the host's own collectives (torch.distributed or Horovod).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import Tensor

from fabric.checkpoint.agreement import on_every_rank
from fabric.checkpoint.plugin import CheckpointPlugin
from fabric.checkpoint.restore import Agreement
from fabric.checkpoint.state import StateDictHooks

__all__ = ["CheckpointFormat", "CheckpointHost", "HostAgreement", "alone"]

#: How a strategy's checkpoints are written (``Strategy.checkpoint_format``): one file from rank 0 through the
#: CheckpointIO plugin, a folder of every rank's shards, or one file of full tensors gathered from sharded objects.
CheckpointFormat = Literal["file", "sharded", "full"]

T = TypeVar("T")


class CheckpointHost(StateDictHooks, Protocol):
    """What the wing needs of a strategy: its format, its CheckpointIO plugin, its ranks, its device and two collectives."""

    @property
    def checkpoint_format(self) -> CheckpointFormat: ...

    @property
    def checkpoint_io(self) -> CheckpointPlugin: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor: ...


class HostAgreement(Agreement):
    """The load walk's agreement over the host's own collectives: :func:`agreement.on_every_rank` (a step alone on one
    process)."""

    def __init__(self, host: CheckpointHost) -> None:
        self._host = host

    def __call__(self, step: Callable[[], T], what: str) -> T:
        host = self._host
        if host.world_size == 1:
            return step()

        def failed_ranks(failed: bool) -> list[int]:
            flags = host.all_gather(torch.tensor([int(failed)], device=host.root_device))
            return [rank for rank, flag in enumerate(flags.reshape(-1).tolist()) if flag]

        return on_every_rank(step, failed_ranks=failed_ranks, broadcast=lambda obj, src: host.broadcast(obj, src=src), what=what)


def alone(step: Callable[[], T], what: str) -> T:
    """No agreement: ``load_raw`` may be called on one rank alone."""
    return step()
