"""The fallback environment: a single process, or ranks started by fabric's own launcher or by hand."""

from __future__ import annotations

import os

from fabric._core.env import find_free_port
from fabric.plugins.environments.base import ClusterEnvironment, checked_int, env_int, env_port

__all__ = ["LightningEnvironment", "LocalEnvironment"]


class LightningEnvironment(ClusterEnvironment):
    """The strategy decides world size and global rank and hands them in through the setters.

    Without ``MASTER_PORT``, :attr:`main_port` picks a free local port once and keeps it; the launcher
    exports it before it starts the other ranks, so they all agree. :meth:`teardown` removes
    ``WORLD_SIZE`` from the environment, as Lightning's does.
    """

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0
        self._main_port: int | None = None

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        raw = os.environ.get("MASTER_ADDR", "").strip()
        return raw or "127.0.0.1"

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return env_port()
        if self._main_port is None:
            self._main_port = find_free_port()
        return self._main_port

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        self._world_size = checked_int("world size", size, 1)

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        self._global_rank = checked_int("global rank", rank, 0)

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        for name in ("NODE_RANK", "GROUP_RANK"):
            if name in os.environ:
                return env_int(name)
        return 0

    def teardown(self) -> None:
        os.environ.pop("WORLD_SIZE", None)


LocalEnvironment = LightningEnvironment
