"""One process, one device: collectives are identities, nothing is launched."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from fabric.strategies.strategy import Strategy


class OneProcessCollectives:
    """The collectives of a strategy whose whole job is this one process: each returns its input.

    ``reduce_op`` is still checked, so a bad one fails in a one-process test run, not first on the cluster.
    """

    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        from fabric.strategies.parallel import check_reduce_op

        check_reduce_op(reduce_op)
        return tensor

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # like Lightning Fabric: with one process no leading world dimension is added
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return bool(decision)


class SingleDeviceStrategy(OneProcessCollectives, Strategy):
    """Runs everything in this process on ``device``."""

    def __init__(self, device: torch.device | str | int = "cpu", accelerator: Any = None, checkpoint_io: Any = None, precision: Any = None) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self._root_device = torch.device(device)

    @property
    @override
    def root_device(self) -> torch.device:
        return self._root_device

    def __repr__(self) -> str:
        return f"SingleDeviceStrategy(device={str(self._root_device)!r})"
