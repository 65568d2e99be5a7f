"""The GPU check's jobs on the CPU: the logic of every CUDA path of ``test_gpu_jobs.py``, in the CPU suite.

The same functions (``support/device_checks.py``) with ``device="cpu"``: gloo instead of NCCL, and where the CPU
cannot take the GPU's path the check says what it runs instead (16-mixed with an explicit CPU GradScaler,
torch.compile's "eager" backend, no pinning, the CPU offload policy off).
"""

from __future__ import annotations

import pytest

from support.device_checks import CHECKS


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.timeout(timeout)) for name, (_, timeout) in CHECKS.items()])
def test_on_the_cpu(name, tmp_path):
    check, _ = CHECKS[name]
    check("cpu", tmp_path)
