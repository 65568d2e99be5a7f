"""The GPU check's single-GPU jobs on ``cuda`` (skipped without a GPU); ``make gpu-check`` runs them.

Each is a function of ``support/device_checks.py`` with the device as a parameter; ``test_cpu_jobs.py`` runs the
same functions on the CPU. One GPU is enough: the DDP, FSDP2 and ModelParallel jobs are world size 1 (NCCL).
"""

from __future__ import annotations

import pytest
import torch

from support.device_checks import CHECKS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.timeout(timeout)) for name, (_, timeout) in CHECKS.items()])
def test_on_the_gpu(name, tmp_path):
    check, _ = CHECKS[name]
    check("cuda", tmp_path)
