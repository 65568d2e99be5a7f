"""Processes started by an MPI launcher (``mpirun``/``mpiexec``); ranks come from mpi4py."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from typing import Any

from fabric._core.env import find_free_port
from fabric.plugins.environments.base import ClusterDecidesRanks, ClusterEnvironment, check_world_size, env_port

__all__ = ["MPIEnvironment"]

_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_MPI_HINT = "MPIEnvironment needs the mpi4py package: `pip install mpi4py`."


def _mpi4py_available() -> bool:
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        # ValueError: a module object without __spec__ already sits in sys.modules.
        return sys.modules.get("mpi4py") is not None


class MPIEnvironment(ClusterDecidesRanks, ClusterEnvironment):
    """Processes started by an MPI launcher; ranks come from ``mpi4py``'s ``COMM_WORLD``.

    All values are gathered with one fixed sequence of collectives the first time any
    of them is asked for, then cached; so every rank must touch the environment (any
    property or rank method) once, as strategies do anyway. The main address and port
    are decided on rank 0 (its ``MASTER_ADDR``/hostname, its ``MASTER_PORT``/a free
    port) and broadcast, so ranks cannot disagree.
    """

    def __init__(self) -> None:
        if not _mpi4py_available():
            raise ImportError(_MPI_HINT)
        self._info: dict[str, Any] | None = None

    @property
    def main_address(self) -> str:
        return self._gather()["main_address"]

    @property
    def main_port(self) -> int:
        return self._gather()["main_port"]

    @staticmethod
    def detect() -> bool:
        """An MPI launcher's variables are set, and mpi4py reports more than one process (as Lightning asks).

        The variables are looked at first, so a plain run never even imports mpi4py.
        """
        if not any(name in os.environ for name in _MPI_MARKERS) or not _mpi4py_available():
            return False
        try:
            from mpi4py import MPI
        except ImportError:
            return False
        return int(MPI.COMM_WORLD.Get_size()) > 1

    def world_size(self) -> int:
        return self._gather()["world_size"]

    def global_rank(self) -> int:
        return self._gather()["global_rank"]

    def local_rank(self) -> int:
        return self._gather()["local_rank"]

    def node_rank(self) -> int:
        return self._gather()["node_rank"]

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        check_world_size("the MPI world size", self.world_size(), num_devices, num_nodes)

    def _gather(self) -> dict[str, Any]:
        if self._info is not None:
            return self._info
        try:
            from mpi4py import MPI
        except ImportError as err:
            raise ImportError(_MPI_HINT) from err

        world = MPI.COMM_WORLD
        rank = int(world.Get_rank())
        size = int(world.Get_size())

        if hasattr(MPI, "COMM_TYPE_SHARED"):
            # Ranks that can share memory are on the same node.
            local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            local_rank = int(local.Get_rank())
            leader = local.bcast(rank, root=0)  # lowest world rank on this node names the node
            local.Free()
            leaders = world.allgather(leader)
            node_rank = sorted(set(leaders)).index(leader)
        else:
            # Pre-MPI-3 libraries: group by processor (host) name instead.
            names = world.allgather(MPI.Get_processor_name())
            me = names[rank]
            local_rank = names[:rank].count(me)
            node_rank = list(dict.fromkeys(names)).index(me)

        endpoint = None
        if rank == 0:
            address = os.environ.get("MASTER_ADDR", "").strip() or socket.gethostname()
            port = env_port() if "MASTER_PORT" in os.environ else find_free_port()
            endpoint = (address, port)
        address, port = world.bcast(endpoint, root=0)

        self._info = {
            "world_size": size,
            "global_rank": rank,
            "local_rank": local_rank,
            "node_rank": node_rank,
            "main_address": address,
            "main_port": int(port),
        }
        return self._info
