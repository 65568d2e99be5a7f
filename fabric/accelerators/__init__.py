"""Accelerators by name: adding one is a file plus a line in ``ACCELERATOR_REGISTRY``."""

from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.cpu import CPUAccelerator
from fabric.accelerators.cuda import CUDAAccelerator
from fabric.accelerators.mps import MPSAccelerator

ACCELERATOR_REGISTRY: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "mps": MPSAccelerator,
}

__all__ = ["ACCELERATOR_REGISTRY", "Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]
