"""A Slurm batch job launched with ``srun``: Slurm starts one task per rank."""

from __future__ import annotations

import os
import signal

from fabric._core.cluster import SLURM_RANK, in_slurm_batch_job
from fabric.plugins.environments.base import ClusterDecidesRanks, ClusterEnvironment, env_int, env_port, env_str, port_from_job_id
from fabric.plugins.environments.slurm_nodelist import parse_slurm_nodelist

__all__ = ["SLURMEnvironment"]

# Ports derived from the job id land in [_JOB_PORT_BASE, _JOB_PORT_BASE + _JOB_PORT_SPAN): below the
# usual Linux ephemeral range (32768+), so an outgoing connection is unlikely to be holding one, and
# two jobs sharing a node only collide when their ids are congruent modulo 10000.
_JOB_PORT_BASE = 10000
_JOB_PORT_SPAN = 10000
_DEFAULT_MAIN_ADDRESS = "127.0.0.1"


class SLURMEnvironment(ClusterDecidesRanks, ClusterEnvironment):
    """Ranks from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``; the main node is the first one listed.

    Args:
        auto_requeue: whether the job should be requeued when Slurm warns of its end (read by whoever
            handles the warning; the environment only carries the choice, as Lightning's does).
        requeue_signal: the signal Slurm sends as that warning (``--signal``); SIGUSR1 by default.

    Interactive allocations (``salloc`` shells, job names ``bash``/``interactive``) are not detected,
    because there the user starts processes themselves. Without ``MASTER_ADDR`` the main address is the
    first host of ``SLURM_NODELIST`` (127.0.0.1 without one); without ``MASTER_PORT`` the port is
    ``10000 + SLURM_JOB_ID % 10000``, identical on every node without any communication.

    Constructing it inside a job whose ``srun`` settings cannot work (``--ntasks`` above 1 without
    ``--ntasks-per-node``) raises ``RuntimeError`` at once.
    """

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None) -> None:
        self.auto_requeue = auto_requeue
        if requeue_signal is None and hasattr(signal, "SIGUSR1"):
            requeue_signal = signal.SIGUSR1
        self.requeue_signal = requeue_signal
        self._check_srun_settings()

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return env_str("MASTER_ADDR")
        for name in ("SLURM_NODELIST", "SLURM_JOB_NODELIST"):
            if name in os.environ:
                return self.resolve_root_node_address(os.environ[name])
        return _DEFAULT_MAIN_ADDRESS

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return env_port()
        return port_from_job_id("SLURM_JOB_ID", _JOB_PORT_BASE, _JOB_PORT_SPAN)

    @staticmethod
    def detect() -> bool:
        return in_slurm_batch_job()

    @staticmethod
    def resolve_root_node_address(nodes: str) -> str:
        """First host of a compact Slurm nodelist, parsed locally (no ``scontrol`` call)."""
        try:
            return next(parse_slurm_nodelist(nodes))
        except StopIteration:  # pragma: no cover - parse_slurm_nodelist rejects empty lists
            raise ValueError(f"Slurm nodelist {nodes!r} names no hosts.") from None

    def world_size(self) -> int:
        return env_int("SLURM_NTASKS", minimum=1)

    def global_rank(self) -> int:
        return env_int(SLURM_RANK)

    def local_rank(self) -> int:
        return env_int("SLURM_LOCALID")

    def node_rank(self) -> int:
        return env_int("SLURM_NODEID")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if "SLURM_NTASKS_PER_NODE" in os.environ:
            per_node = env_int("SLURM_NTASKS_PER_NODE", minimum=1)
            if per_node != num_devices:
                raise ValueError(
                    f"SLURM_NTASKS_PER_NODE={per_node} but devices={num_devices}; Slurm must start one task per"
                    " device, so set --ntasks-per-node to the number of devices."
                )
        if "SLURM_NNODES" in os.environ:
            nodes = env_int("SLURM_NNODES", minimum=1)
            if nodes != num_nodes:
                raise ValueError(
                    f"SLURM_NNODES={nodes} but num_nodes={num_nodes}; set num_nodes to the number of allocated nodes."
                )

    @staticmethod
    def _check_srun_settings() -> None:
        """``srun --ntasks=N`` alone spreads N tasks over nodes in a way the ranks cannot be derived from."""
        if not SLURMEnvironment.detect():
            return
        ntasks = env_int("SLURM_NTASKS", minimum=1)
        if ntasks > 1 and "SLURM_NTASKS_PER_NODE" not in os.environ:
            raise RuntimeError(
                f"The Slurm job was started with --ntasks={ntasks} but without --ntasks-per-node, which fabric"
                f" cannot place ranks with. Use --ntasks-per-node={ntasks} (per node) with --nodes instead."
            )
