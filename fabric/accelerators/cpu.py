"""CPU: ``devices`` is the number of processes, every one of them on ``torch.device("cpu")``."""

from __future__ import annotations

from typing import Any

import torch

from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.exceptions import InvalidArgumentError


class CPUAccelerator(Accelerator):
    name = "cpu"

    def setup_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"CPUAccelerator was given the device {device}; it only runs on 'cpu'")

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return parse_cpu_cores(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cpu")] * parse_cpu_cores(devices)

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True


#: The most CPU processes one machine runs for a job: each is an interpreter with its own copy of torch
#: (hundreds of MB), so far fewer already exhaust a machine; beyond this the number is a typo.
MAX_CPU_PROCESSES = 1024


def parse_cpu_cores(devices: Any) -> int:
    """``devices`` for the CPU: a positive int (or a string of one) counting processes, at most
    :data:`MAX_CPU_PROCESSES`; "auto" means 1."""
    if devices == "auto":
        return 1
    value = devices
    if isinstance(devices, str) and devices.strip().isdigit():
        value = int(devices)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        # a wrong type is a TypeError in Lightning Fabric, a ValueError here before: the error is both
        error = ValueError if isinstance(value, int) and not isinstance(value, bool) else InvalidArgumentError
        raise error(
            f"devices={devices!r} is not valid for the CPU accelerator; accepted: a positive int"
            " (the number of processes) or 'auto'"
        )
    if value > MAX_CPU_PROCESSES:
        raise ValueError(
            f"devices={devices!r} asks for {value} CPU processes on one machine; accepted: 1 to {MAX_CPU_PROCESSES}"
            " (each process is an interpreter with its own copy of torch)"
        )
    return value
