"""Type names Lightning Fabric users import from ``lightning.fabric.utilities.types``.

Structural types (``Protocol``s checkable with ``isinstance``) for what the training loop hands around:
an optimizer-like object, a process group, a stateful object; and the aliases for paths and devices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeAlias, TypeVar, overload, runtime_checkable

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

__all__ = [
    "CollectibleGroup",
    "LRScheduler",
    "Optimizable",
    "ProcessGroup",
    "RedOpType",
    "ReduceLROnPlateau",
    "ReduceOp",
    "Steppable",
]

UntypedStorage: TypeAlias = torch.UntypedStorage

_PATH: TypeAlias = str | Path
_DEVICE: TypeAlias = torch.device | str | int
_MAP_LOCATION_TYPE: TypeAlias = _DEVICE | Callable[[UntypedStorage, str], UntypedStorage | None] | dict[_DEVICE, _DEVICE] | None
_PARAMETERS: TypeAlias = Iterator[torch.nn.Parameter]
# the learning-rate schedulers torch ships (older Lightning code imports this name)
_TORCH_LRSCHEDULER: TypeAlias = LRScheduler

if torch.distributed.is_available():
    from torch.distributed import ProcessGroup, ReduceOp

    RedOpType: TypeAlias = ReduceOp.RedOpType
else:  # a build without torch.distributed: the names exist, nothing is an instance of them
    ProcessGroup = Any  # type: ignore[assignment,misc]
    ReduceOp = RedOpType = object  # type: ignore[assignment,misc]

_DictKey = TypeVar("_DictKey")


@runtime_checkable
class _Stateful(Protocol[_DictKey]):
    """Anything with ``state_dict()`` and ``load_state_dict()``."""

    def state_dict(self) -> dict[_DictKey, Any]: ...

    def load_state_dict(self, state_dict: dict[_DictKey, Any]) -> None: ...


@runtime_checkable
class CollectibleGroup(Protocol):
    """A group of ranks, as ``torch.distributed.new_group`` returns one."""

    def size(self) -> int: ...

    def rank(self) -> int: ...


@runtime_checkable
class Steppable(Protocol):
    """Anything with an optimizer's ``step(closure=None)``."""

    @overload
    def step(self, closure: None = ...) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = ...) -> float | None: ...


@runtime_checkable
class Optimizable(Steppable, Protocol):
    """Anything used like a ``torch.optim.Optimizer``: steps, parameter groups, state and a state dict."""

    param_groups: list[dict[Any, Any]]
    defaults: dict[Any, Any]
    state: defaultdict[Tensor, Any]

    def state_dict(self) -> dict[str, dict[Any, Any]]: ...

    def load_state_dict(self, state_dict: dict[str, dict[Any, Any]]) -> None: ...
