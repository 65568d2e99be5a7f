"""Which environment is this process in? The detection order, and the rank for rank-zero-only output."""

from __future__ import annotations

from fabric._core.cluster import rank_from_environment
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
