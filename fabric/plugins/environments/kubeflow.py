"""A Kubeflow PyTorchJob: the operator runs one process per pod and exports its rank."""

from __future__ import annotations

import os

from fabric._core.cluster import TORCHRUN_RANK
from fabric.plugins.environments.base import ClusterDecidesRanks, ClusterEnvironment, check_world_size, env_int

__all__ = ["KubeflowEnvironment"]


class KubeflowEnvironment(ClusterDecidesRanks, ClusterEnvironment):
    """One rank per pod: the pod's rank is also its node's rank."""

    _REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    # Present when another launcher runs inside the pod; then that launcher's environment wins.
    _EXCLUDED = ("SLURM_NTASKS", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")

    @staticmethod
    def detect() -> bool:
        env = os.environ
        required = all(name in env for name in KubeflowEnvironment._REQUIRED)
        return required and not any(name in env for name in KubeflowEnvironment._EXCLUDED)

    def world_size(self) -> int:
        return env_int("WORLD_SIZE", minimum=1)

    def global_rank(self) -> int:
        return env_int(TORCHRUN_RANK)

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return env_int(TORCHRUN_RANK)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        check_world_size("WORLD_SIZE", self.world_size(), num_devices, num_nodes)
