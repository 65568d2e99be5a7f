"""The process group across replica groups, listening on the job's address only.

torchft rebuilds a gloo process group across the groups at every new quorum. Left to itself, gloo listens on the
address this machine's name resolves to (or the interface ``GLOO_SOCKET_IFNAME`` names), which is another
network than the job's when the groups all run here, or when the machine has several. This group's gloo device is
bound to the job's address instead (loopback when every group runs on this machine): torchft's
``ProcessGroupGloo`` with only its backend's construction replaced.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ProcessGroup, ProcessGroupGloo
from torchft.process_group import ProcessGroupGloo as TorchftProcessGroupGloo

__all__ = ["ReplicaProcessGroupGloo"]


class ReplicaProcessGroupGloo(TorchftProcessGroupGloo):
    """torchft's reconfigurable gloo group whose sockets are on ``host``.

    Args:
        host: the job's address on this machine (an IP address).
        timeout: how long one collective across groups may take.
    """

    def __init__(self, host: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self._host = host

    def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroup:
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [ProcessGroupGloo.create_device(hostname=self._host)]
        options._timeout = self._timeout
        options._threads = 2
        if self._global_ranks:
            options.global_ranks_in_group = self._global_ranks
        if self._group_rank is not None and self._group_world_size:
            options.group_name = f"fabric_replicas_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
        backend = ProcessGroupGloo(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        group = ProcessGroup(store, rank, world_size)
        group._set_default_backend(ProcessGroup.BackendType.GLOO)
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
        for device in devices:
            group._register_backend(device, ProcessGroup.BackendType.GLOO, backend)
        return group
