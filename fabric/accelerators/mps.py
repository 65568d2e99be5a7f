"""Apple-silicon GPUs (Metal Performance Shaders): one device per machine."""

from __future__ import annotations

import platform
from typing import Any

import torch

from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.cuda import parse_gpu_ids


class MPSAccelerator(Accelerator):
    name = "mps"

    def setup_device(self, device: torch.device) -> None:
        if device.type != "mps":
            raise ValueError(f"MPSAccelerator was given the device {device}; it only runs on 'mps'")

    def teardown(self) -> None:
        if self.is_available():
            torch.mps.empty_cache()

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return parse_gpu_ids(devices, MPSAccelerator.auto_device_count(), "mps")

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("mps", index) for index in devices]

    @staticmethod
    def auto_device_count() -> int:
        return 1 if MPSAccelerator.is_available() else 0

    @staticmethod
    def is_available() -> bool:
        mps = getattr(torch.backends, "mps", None)
        return bool(mps and mps.is_available() and platform.processor() in ("arm", "arm64"))
