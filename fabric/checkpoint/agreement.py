"""How every rank learns the outcome of a checkpoint step, so that no rank waits for a file that will not come, or
goes on alone, and every rank raises the same error. The result or the error travels through the strategy's broadcast
(torch.distributed or Horovod); a failed rank raises its own exception (with its traceback), the others the same
class (or RuntimeError, for a class they could not rebuild) with its message.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "Outcome",
    "agree_in_group",
    "broadcast_in_group",
    "gather_in_group",
    "on_every_rank",
    "on_rank_zero",
    "rank_in_group",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """Rank 0's result of a step, as every rank learns it (picklable; no traceback)."""

    value: Any = None
    error_type: type[BaseException] | None = None
    message: str = ""

    @classmethod
    def of_error(cls, error: BaseException) -> Outcome:
        error_type: type[BaseException] = type(error)
        try:
            pickle.dumps(error_type)
        except Exception:  # a class the other ranks could not unpickle (defined in a function)
            error_type = RuntimeError
        return cls(None, error_type, f"{type(error).__name__}: {error}" if error_type is not type(error) else str(error))

    def result(self, origin: str = "Rank 0 failed to save the checkpoint") -> Any:
        """The value, or the error rebuilt from the failed rank's class and message (after ``origin``)."""
        if self.error_type is None:
            return self.value
        text = f"{origin}: {self.message}"
        try:
            error = self.error_type(text)
        except Exception:  # an exception class that takes other arguments: keep the message
            error = RuntimeError(f"{self.error_type.__name__}: {text}")
        raise error


def on_rank_zero(
    step: Callable[[], T], *, rank: int, broadcast: Callable[[Any], Any], origin: str = "Rank 0 failed to save the checkpoint"
) -> T:
    """Run ``step`` on rank 0 only; every rank returns its value or raises its error (after ``origin``). A collective."""
    outcome, error = Outcome(), None
    if rank == 0:
        try:
            outcome = Outcome(step())
        except Exception as err:
            outcome, error = Outcome.of_error(err), err
    outcome = broadcast(outcome)
    if error is not None:
        raise error
    return outcome.result(origin)


def on_every_rank(
    step: Callable[[], T],
    *,
    failed_ranks: Callable[[bool], list[int]],
    broadcast: Callable[[Any, int], Any],
    what: str,
) -> T:
    """Run ``step`` on every rank; if it fails on any rank, raise on every rank (naming the first failed rank and
    ``what`` it could not do). A collective: ``failed_ranks(failed)`` gives every rank the list of ranks that failed,
    ``broadcast(obj, src)`` the first failed rank's error."""
    value: Any = None
    error: BaseException | None = None
    try:
        value = step()
    except Exception as err:
        error = err
    failed = failed_ranks(error is not None)
    if not failed:
        return value
    outcome = broadcast(Outcome.of_error(error) if error is not None else Outcome(), failed[0])
    if error is not None:
        raise error
    return outcome.result(f"Rank {failed[0]} could not {what}, so no rank changed anything")


def agree_in_group(step: Callable[[], T], what: str, group: Any = None) -> T:
    """:func:`on_every_rank` over torch.distributed's ``group`` (``step()`` alone without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return step()

    def failed_ranks(failed: bool) -> list[int]:
        flags: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(flags, failed, group=group)  # objects: the group's device is torch's business (NCCL)
        return [rank for rank, flag in enumerate(flags) if flag]

    return on_every_rank(step, failed_ranks=failed_ranks, broadcast=lambda obj, src: broadcast_in_group(obj, group, src), what=what)


def broadcast_in_group(obj: Any, group: Any = None, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank of ``group`` over torch.distributed (``obj`` itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, group=group, group_src=src)
    return holder[0]


def gather_in_group(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 of ``group``, in rank order (None on the other ranks); ``[obj]`` without a
    process group. A collective (objects: the group's device is torch's business, as in :func:`agree_in_group`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, gathered, group=group, group_dst=0)
    return gathered


def rank_in_group(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
