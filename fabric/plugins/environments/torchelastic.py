"""Processes started by ``torchrun`` (torch.distributed.elastic), or by ``fabric-torch run``."""

from __future__ import annotations

import os

from fabric._core.cluster import TORCHRUN_RANK
from fabric.plugins.environments.base import ClusterDecidesRanks, ClusterEnvironment, check_world_size, env_int

__all__ = ["TorchElasticEnvironment"]


class TorchElasticEnvironment(ClusterDecidesRanks, ClusterEnvironment):
    """Every rank and the rendezvous point come from the variables torchrun exports.

    Detected as Lightning detects it, by ``TORCHELASTIC_RUN_ID`` (torchrun sets it for every job), and
    also by the four rank variables ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    together, which ``fabric-torch run`` and the popen launcher export without a run id.
    """

    _MARKERS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

    @staticmethod
    def detect() -> bool:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            return True
        return all(name in os.environ for name in TorchElasticEnvironment._MARKERS)

    def world_size(self) -> int:
        return env_int("WORLD_SIZE", minimum=1)

    def global_rank(self) -> int:
        return env_int(TORCHRUN_RANK)

    def local_rank(self) -> int:
        return env_int("LOCAL_RANK")

    def node_rank(self) -> int:
        return env_int("GROUP_RANK")

    def local_world_size(self) -> int:
        """Processes torchrun started on this node (``LOCAL_WORLD_SIZE``)."""
        return env_int("LOCAL_WORLD_SIZE", minimum=1)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        check_world_size("WORLD_SIZE", self.world_size(), num_devices, num_nodes)
