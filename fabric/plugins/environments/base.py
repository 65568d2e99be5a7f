"""The interface of a cluster environment, and how environments read the variables they are given.

A strategy needs four facts before it can join a process group: how many processes there are, which
one this is, where rank 0 listens, and whether somebody else already started all the processes. Every
scheduler and launcher answers those questions through different environment variables; the classes
of this package translate them into one interface, and they are the only part of fabric that reads a
rank's position from the environment.

Rules shared by every environment:

* A variable that is required but missing, or set to something that is not a well-formed value
  (``RANK="x"``, a negative size, a port above 65535), raises ``ValueError`` naming the variable and
  the offending value.
* Environments never write ``MASTER_ADDR``/``MASTER_PORT``; the launchers and strategies export the
  rendezvous point in one place (``fabric._core.env.export_rendezvous``).
* Only the standard library is imported (``mpi4py`` lazily, by the MPI environment).
"""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from typing import Any

__all__ = ["ClusterEnvironment"]

log = logging.getLogger("fabric.plugins.environments")

_INT_PATTERN = re.compile(r"\s*[+-]?[0-9]+\s*")


def parse_int(name: str, raw: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Turn the text of variable ``name`` into an int, or say exactly what is wrong with it."""
    if not _INT_PATTERN.fullmatch(raw):
        raise ValueError(f"Environment variable {name}={raw!r} is not an integer.")
    value = int(raw)
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and at most {maximum}"
        raise ValueError(f"Environment variable {name}={raw!r} is out of range: expected at least {minimum}{upper}.")
    return value


def env_int(name: str, default: int | None = None, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Read an integer variable; a missing variable falls back to ``default`` or is an error."""
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"Environment variable {name} is required here but is not set.")
        return default
    return parse_int(name, raw, minimum=minimum, maximum=maximum)


def env_port(name: str = "MASTER_PORT") -> int:
    return env_int(name, minimum=1, maximum=65535)


def env_str(name: str) -> str:
    """Read a required, non-empty string variable."""
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(f"Environment variable {name} is required here but is not set.")
    if not raw.strip():
        raise ValueError(f"Environment variable {name}={raw!r} is empty.")
    return raw.strip()


def checked_int(name: str, value: Any, minimum: int) -> int:
    """Validate an argument a strategy passes in (not an env var), so bad calls fail early."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def check_world_size(source: str, world_size: int, num_devices: int, num_nodes: int) -> None:
    """The job the cluster started must be the job the configuration describes."""
    expected = num_devices * num_nodes
    if world_size != expected:
        raise ValueError(
            f"The cluster reports {source}={world_size} processes, but the configuration asks for"
            f" devices={num_devices} x num_nodes={num_nodes} = {expected}. Make them agree."
        )


class ClusterEnvironment(ABC):
    """Describes the job this process belongs to, so a strategy can join the process group."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """True when an outside launcher already started every rank, so we must start none."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Host that rank 0 listens on for the rendezvous."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port that rank 0 listens on for the rendezvous."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether the current process runs under this environment."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the whole job."""

    @abstractmethod
    def set_world_size(self, size: int) -> None:
        """Let the strategy tell the environment the world size (ignored where the cluster decides)."""

    @abstractmethod
    def global_rank(self) -> int:
        """Index of this process among all processes of the job."""

    @abstractmethod
    def set_global_rank(self, rank: int) -> None:
        """Let the strategy tell the environment the global rank (ignored where the cluster decides)."""

    @abstractmethod
    def local_rank(self) -> int:
        """Index of this process among the processes on its node; picks the device."""

    @abstractmethod
    def node_rank(self) -> int:
        """Index of this process's node among the job's nodes."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise ``ValueError`` if the user's configuration contradicts what the cluster says.

        The connector calls it with the devices per node and nodes it decided on, before any process
        group is formed, so a job of the wrong size fails at once instead of hanging in the rendezvous.
        """

    def teardown(self) -> None:
        """Undo any changes this environment made to the process (e.g. env vars it set)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ClusterDecidesRanks:
    """Mixin for environments whose launcher started every rank: ranks come from it, setters only log.

    The rendezvous point defaults to MASTER_ADDR/MASTER_PORT, as torchrun and Kubeflow export them.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return env_str("MASTER_ADDR")

    @property
    def main_port(self) -> int:
        return env_port()

    def set_world_size(self, size: int) -> None:
        log.debug("%s ignores set_world_size(%r); the world size comes from the environment.", type(self).__name__, size)

    def set_global_rank(self, rank: int) -> None:
        log.debug("%s ignores set_global_rank(%r); the rank comes from the environment.", type(self).__name__, rank)


def port_from_job_id(name: str, base: int, span: int) -> int:
    """Map a numeric scheduler job id to a port, so every rank of the job derives the same one."""
    return base + env_int(name) % span
