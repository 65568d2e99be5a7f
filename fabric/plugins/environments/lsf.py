"""An IBM Spectrum LSF job launched with ``jsrun``."""

from __future__ import annotations

import os
import socket

from fabric._core.cluster import LSF_RANK
from fabric.plugins.environments.base import ClusterDecidesRanks, ClusterEnvironment, check_world_size, env_int, env_port, port_from_job_id

__all__ = ["LSFEnvironment"]

# As Lightning's: the port is 10000 + LSB_JOBID % 1000, the same on every host of the job.
_JOB_PORT_BASE = 10000
_JOB_PORT_SPAN = 1000
_RANKFILE = "LSB_DJOB_RANKFILE"


def _same_host(a: str, b: str) -> bool:
    """Compare host names, tolerating one side being fully qualified and the other short."""
    return a == b or a.split(".", 1)[0] == b.split(".", 1)[0]


class LSFEnvironment(ClusterDecidesRanks, ClusterEnvironment):
    """Ranks from the ``JSM_NAMESPACE_*`` variables; hosts from the rank file.

    The rank file (``LSB_DJOB_RANKFILE``) lists one host per line, the first line being the launch node,
    which runs no rank and is skipped. The node rank is this host's place among the compute hosts, the
    main address the first of them. Without ``MASTER_PORT`` the port is ``10000 + LSB_JOBID % 1000``.

    As with Lightning, a missing or empty ``LSB_DJOB_RANKFILE`` or a missing ``LSB_JOBID`` raises
    ``ValueError`` when the environment is created.
    """

    _MARKERS = ("LSB_JOBID", _RANKFILE, "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")

    def __init__(self) -> None:
        self._hosts = self._compute_hosts()
        self._main_port = self._read_main_port()

    @property
    def main_address(self) -> str:
        return self._hosts[0]

    @property
    def main_port(self) -> int:
        return self._main_port

    @staticmethod
    def detect() -> bool:
        return all(name in os.environ for name in LSFEnvironment._MARKERS)

    def world_size(self) -> int:
        return env_int("JSM_NAMESPACE_SIZE", minimum=1)

    def global_rank(self) -> int:
        return env_int(LSF_RANK)

    def local_rank(self) -> int:
        return env_int("JSM_NAMESPACE_LOCAL_RANK")

    def node_rank(self) -> int:
        me = socket.gethostname()
        for index, host in enumerate(self._hosts):
            if _same_host(host, me):
                return index
        raise ValueError(f"This host {me!r} is not among the compute hosts in {_RANKFILE}={os.environ[_RANKFILE]!r}.")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        check_world_size("JSM_NAMESPACE_SIZE", self.world_size(), num_devices, num_nodes)

    @staticmethod
    def _read_main_port() -> int:
        if "MASTER_PORT" in os.environ:
            return env_port()
        if "LSB_JOBID" not in os.environ:
            raise ValueError("Environment variable LSB_JOBID is not set; the LSF job id gives the main port.")
        return port_from_job_id("LSB_JOBID", _JOB_PORT_BASE, _JOB_PORT_SPAN)

    @staticmethod
    def _compute_hosts() -> list[str]:
        """Distinct compute hosts from the rank file, in order of first appearance."""
        path = os.environ.get(_RANKFILE)
        if path is None:
            raise ValueError(f"Environment variable {_RANKFILE} is not set; LSF names the job's hosts there.")
        if not path.strip():
            raise ValueError(f"Environment variable {_RANKFILE} is empty; LSF names the job's hosts there.")
        try:
            with open(path, encoding="utf-8") as handle:
                lines = [line.strip() for line in handle]
        except OSError as err:
            raise ValueError(f"{_RANKFILE}={path!r} cannot be read: {err}") from err
        hosts = list(dict.fromkeys(line for line in lines[1:] if line))  # skip the launch node
        if not hosts:
            raise ValueError(f"{_RANKFILE}={path!r} lists no compute hosts after the launch node.")
        return hosts
