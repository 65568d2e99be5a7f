"""Distributed helpers with the public names of ``lightning.fabric.utilities.distributed``.

``DistributedSamplerWrapper`` shards any sampler; ``is_shared_filesystem`` tells whether all ranks see
the same files under a path; ``ReduceOp`` and ``group`` are torch.distributed's, re-exported.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

if torch.distributed.is_available():
    from torch.distributed import ReduceOp, group
else:  # a torch built without distributed support: the names still import

    class ReduceOp:  # type: ignore[no-redef]
        SUM = "sum"

    class group:  # type: ignore[no-redef]  # lower case: it stands in for torch.distributed.group
        WORLD = None


class _SamplerIndices(Dataset):
    """The indices one pass of a user's sampler yields, seen as a dataset so it can be sharded."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._indices: list[Any] | None = None

    def refresh(self) -> None:
        self._indices = list(self.sampler)

    def __getitem__(self, position: int) -> Any:
        if self._indices is None:
            self.refresh()
        assert self._indices is not None
        return self._indices[position]

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


class DistributedSamplerWrapper(DistributedSampler):
    """Shards whatever a user's own sampler yields (weighted, custom order, ...) across ranks.

    Each epoch, the user's sampler is drawn once (the same way on every rank when it is seeded), and
    every rank takes its own disjoint share of that draw. The other arguments are DistributedSampler's
    (``num_replicas``, ``rank``, ``shuffle`` - True by default, as there -, ``seed``, ``drop_last``).
    """

    def __init__(self, sampler: Sampler, *args: Any, **kwargs: Any) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(f"{type(sampler).__name__} has no len(); a sampler must have one to be sharded")
        super().__init__(_SamplerIndices(sampler), *args, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        indices: _SamplerIndices = self.dataset  # type: ignore[assignment]
        indices.refresh()
        return (indices[position] for position in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        """Also tell the wrapped sampler, when it draws differently per epoch."""
        super().set_epoch(epoch)
        set_epoch = getattr(self.dataset.sampler, "set_epoch", None)  # type: ignore[attr-defined]
        if callable(set_epoch):
            set_epoch(epoch)


def is_shared_filesystem(strategy: Any, path: str | Path | None = None, timeout: int = 3) -> bool:
    """Whether every rank of ``strategy`` sees the same files under ``path`` (default: the working folder).

    Rank 0 creates a marker file; the other ranks look for it for up to ``timeout`` seconds. A remote
    URL (``s3://...``) counts as shared; so does a single process. Call it on every rank.
    """
    from fabric._core.urls import is_url, local_or_url

    if path is not None:
        path = local_or_url(path)  # a URL: its store must be reachable (else a clear error), and counts as shared
        if is_url(path):
            return True
    folder = Path(Path.cwd() if path is None else path).resolve()
    if getattr(strategy, "world_size", 1) == 1:
        return True
    if not strategy.reduce_boolean_decision(strategy.broadcast(folder) == folder, all=True):
        return False  # the ranks do not even name the same path
    if not strategy.reduce_boolean_decision(folder.exists(), all=True):
        raise FileNotFoundError(f"is_shared_filesystem(path={str(folder)!r}): the path does not exist on every rank")
    if folder.is_file():
        folder = folder.parent
    marker = folder / ".fabric_shared_fs_check"
    if strategy.is_global_zero:
        marker.unlink(missing_ok=True)  # a stale marker of a crashed run must not count
    strategy.barrier()
    if strategy.is_global_zero:
        marker.touch()
        found = True
    else:
        deadline = time.monotonic() + timeout
        found = marker.exists()
        while not found and time.monotonic() < deadline:
            time.sleep(0.01)
            found = marker.exists()
    strategy.barrier()
    shared = strategy.reduce_boolean_decision(found, all=True)
    if strategy.is_global_zero:
        with contextlib.suppress(OSError):
            marker.unlink()
    return shared


__all__ = ["DistributedSamplerWrapper", "ReduceOp", "group", "is_shared_filesystem"]
