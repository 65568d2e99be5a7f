"""Which environment is this process in? The detection order, and the rank for rank-zero-only output."""

from __future__ import annotations

import os

from fabric.plugins.environments.base import ClusterEnvironment, log
from fabric.plugins.environments.kubeflow import KubeflowEnvironment
from fabric.plugins.environments.lightning import LightningEnvironment
from fabric.plugins.environments.lsf import LSFEnvironment
from fabric.plugins.environments.mpi import MPIEnvironment
from fabric.plugins.environments.slurm import SLURMEnvironment
from fabric.plugins.environments.torchelastic import TorchElasticEnvironment

__all__ = ["detect_cluster_environment", "rank_from_environment"]

_DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
)

# Where each launcher puts the global rank: torchrun/fabric run/Kubeflow, Slurm, LSF, Open MPI, MPICH/PMI,
# horovodrun.
_GLOBAL_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK")


def detect_cluster_environment() -> ClusterEnvironment:
    """Instantiate the first environment that recognises the current process.

    The order runs from the most specific markers to the least: torchrun, Slurm, LSF, MPI, Kubeflow,
    and finally :class:`LightningEnvironment`, which always matches.
    """
    for env_cls in _DETECTION_ORDER:
        if env_cls.detect():
            log.debug("Detected cluster environment %s.", env_cls.__name__)
            return env_cls()
    return LightningEnvironment()  # pragma: no cover - LightningEnvironment.detect() is always True


def rank_from_environment() -> int:
    """The global rank a launcher exported to this process, 0 when none did.

    For rank-zero-only output at import time, before any strategy exists: it never raises and never
    talks to a launcher (no mpi4py), it only reads the variables the launchers set.
    """
    for name in _GLOBAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0
