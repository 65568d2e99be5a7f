"""NVIDIA GPUs. The parsing of ``devices=`` is pure so it is tested on machines without a GPU."""

from __future__ import annotations

from typing import Any

import torch

from fabric._core.devices import DevicesSyntaxError, parse_devices
from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.exceptions import InvalidArgumentError


class CUDAAccelerator(Accelerator):
    name = "cuda"

    def setup_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDAAccelerator was given the device {device}; it only runs on 'cuda'")
        torch.cuda.set_device(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return parse_gpu_ids(devices, num_cuda_devices(), "cuda")

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cuda", index) for index in devices]

    @staticmethod
    def auto_device_count() -> int:
        return num_cuda_devices()

    @staticmethod
    def is_available() -> bool:
        return num_cuda_devices() > 0


def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """Indices of ``num_devices`` GPUs this process can use now (-1: every usable one), e.g. ``devices=`` for Fabric.

    A GPU counts as usable when a tensor can be created on it; one taken by another process in
    "exclusive" compute mode cannot. Two processes asking at the same moment may both get the same GPU.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < -1:
        raise ValueError(f"find_usable_cuda_devices(num_devices={num_devices!r}); accepted: -1 (all) or an int >= 0")
    if num_devices == 0:
        return []
    visible = num_cuda_devices()
    if visible == 0:
        raise ValueError(f"find_usable_cuda_devices({num_devices}): there are no CUDA devices visible on this machine")
    if num_devices > visible:
        raise ValueError(f"find_usable_cuda_devices({num_devices}): this machine has only {visible} visible GPU(s)")
    usable: list[int] = []
    busy: list[int] = []
    for index in range(visible):
        if len(usable) == num_devices:
            break
        try:
            torch.empty(1, device=torch.device("cuda", index))
        except RuntimeError:
            busy.append(index)
        else:
            usable.append(index)
    if num_devices != -1 and len(usable) < num_devices:
        raise RuntimeError(
            f"find_usable_cuda_devices({num_devices}): only {len(usable)} GPU(s) can be used now; {busy} are"
            " occupied by other processes"
        )
    return usable


def num_cuda_devices() -> int:
    """Visible GPUs, counted without initializing CUDA (so forked processes can still use it)."""
    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()


def parse_gpu_ids(devices: Any, available: int, accelerator: str) -> list[int]:
    """Turn a user's ``devices=`` into GPU indices, checked against the ``available`` count.

    The syntax is ``fabric._core.devices``'s, the one ``fabric run --devices`` accepts too.
    """
    try:
        parsed = parse_devices(devices)
    except DevicesSyntaxError:
        # a wrong type is a TypeError in Lightning Fabric, a ValueError here before: the error is both
        wrong_type = isinstance(devices, bool) or not isinstance(devices, (int, str, list, tuple))
        raise (InvalidArgumentError if wrong_type else ValueError)(
            f"devices={devices!r} is not valid for the {accelerator.upper()} accelerator; accepted: 'auto', -1,"
            " a positive int, a string like '0,1', or a list of indices like [0, 1]"
        ) from None
    if parsed == "all":
        if available == 0:
            raise RuntimeError(f"devices={devices!r} asks for every {accelerator.upper()} device, but none is available")
        return list(range(available))
    indices = list(range(parsed)) if isinstance(parsed, int) else parsed
    missing = [i for i in indices if i >= available]
    if missing:
        have = f"only {available} (indices 0..{available - 1}) are available" if available else "none is available"
        raise RuntimeError(f"devices={devices!r} asks for {accelerator.upper()} device(s) {missing}, but {have}")
    return indices
