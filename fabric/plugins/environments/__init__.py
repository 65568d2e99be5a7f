"""Cluster environments: where does this process sit in a (possibly multi-node) job?

One module per scheduler or launcher, all behind :class:`ClusterEnvironment` (``base``); which one
applies is decided by :func:`detect_cluster_environment` (``detection``). They import only the standard
library (``mpi4py`` lazily), so ``fabric run`` can use them before any rank starts.
"""

from fabric._core.env import find_free_port
from fabric.plugins.environments.base import ClusterEnvironment
from fabric.plugins.environments.detection import detect_cluster_environment, rank_from_environment
from fabric.plugins.environments.kubeflow import KubeflowEnvironment
from fabric.plugins.environments.lightning import LightningEnvironment, LocalEnvironment
from fabric.plugins.environments.lsf import LSFEnvironment
from fabric.plugins.environments.mpi import MPIEnvironment
from fabric.plugins.environments.slurm import SLURMEnvironment
from fabric.plugins.environments.slurm_nodelist import parse_slurm_nodelist
from fabric.plugins.environments.torchelastic import TorchElasticEnvironment

__all__ = [
    "ClusterEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LightningEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_cluster_environment",
    "find_free_port",
    "parse_slurm_nodelist",
    "rank_from_environment",
]
