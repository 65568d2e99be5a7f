"""Where a process sits in a Horovod job: ``horovodrun`` started every process and Horovod knows the ranks."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from fabric._core.cluster import HOROVOD_RANK
from fabric.plugins.environments import ClusterEnvironment

__all__ = ["HorovodEnvironment"]


class HorovodEnvironment(ClusterEnvironment):
    """The ranks as Horovod reports them, so HorovodStrategy inherits ParallelStrategy's rank properties.

    ``horovod`` returns the initialized ``horovod.torch`` module (Horovod starts on the first question).
    The rendezvous is horovodrun's own; the setters are ignored because horovodrun decides the ranks.
    """

    def __init__(self, horovod: Callable[[], Any]) -> None:
        self._horovod = horovod

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "0"))

    @staticmethod
    @override
    def detect() -> bool:
        return HOROVOD_RANK in os.environ

    @override
    def world_size(self) -> int:
        return self._horovod().size()

    @override
    def set_world_size(self, size: int) -> None: ...

    @override
    def global_rank(self) -> int:
        return self._horovod().rank()

    @override
    def set_global_rank(self, rank: int) -> None: ...

    @override
    def local_rank(self) -> int:
        return self._horovod().local_rank()

    @override
    def node_rank(self) -> int:
        return self._horovod().cross_rank()
