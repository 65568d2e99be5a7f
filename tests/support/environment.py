"""The environment of a job a test starts: nothing of an outer job or launcher gets in, a free port."""

from __future__ import annotations

import os
from typing import Any

from fabric._core.env import ENV_PREFIX, find_free_port
from support import REPO, TESTS

# Variables of an outer job or launcher (or of `fabric run` options) that must not reach a job a test starts.
JOB_PREFIXES = (ENV_PREFIX, "LT_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "LSB_", "JSM_", "HOROVOD_")
JOB_NAMES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "OMP_NUM_THREADS", "KUBERNETES_PORT", "WORKER_SETUP_IDX",
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now: fabric's own torch-free finder, the one users get."""
    return find_free_port(host)


def is_job_variable(name: str) -> bool:
    return name.startswith(JOB_PREFIXES) or name in JOB_NAMES


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without job variables; this checkout's ``fabric`` and ``support`` importable."""
    env = {name: value for name, value in os.environ.items() if not is_job_variable(name)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(TESTS), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def job_environment(**extra: str) -> dict[str, str]:
    """``clean_env`` for a local gloo job: a free rendezvous port, one thread per rank (ranks share two cores)."""
    return clean_env(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", **extra)


def isolate(monkeypatch: Any) -> None:
    """The same for a job started from the test process itself (through ``monkeypatch``, undone after the test)."""
    for name in [name for name in os.environ if is_job_variable(name)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
