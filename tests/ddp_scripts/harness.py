"""Running the real 2-process jobs from the test process: clean environment, free port, hard timeouts.

A job's results are memoized per test session, so several test files can assert on one job without
paying for its processes twice (each job costs seconds of torch imports).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parents[1]

# variables that would make a job think it already runs under some launcher
JOB_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
)

_memo: dict[str, Any] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolate(monkeypatch: Any) -> None:
    """For a job started from the test process itself: no launcher or FABRIC_* variables, a free port."""
    for name in [n for n in os.environ if n in JOB_VARIABLES or n.startswith("FABRIC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def job_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES and not k.startswith("FABRIC_")}
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores: one thread each, as torchrun would set
    return env


class JobFailed(AssertionError):
    pass


def run_popen_job(outdir: Path, timeout: float = 120) -> dict[str, Any]:
    """Run ``popen_job.py`` (rank 0 here, rank 1 started by Fabric); return both ranks' results and the output."""
    outdir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "popen_job.py"), str(outdir)],
        env=job_environment(),
        cwd=outdir,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise JobFailed(f"popen job failed with {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}")
    ranks = {r: torch.load(outdir / f"rank{r}.pt", weights_only=True) for r in range(2)}
    return {"ranks": ranks, "stdout": result.stdout, "stderr": result.stderr, "files": sorted(p.name for p in outdir.iterdir())}


def popen_results(tmp_path_factory: Any) -> dict[str, Any]:
    """The popen job's results, run once per session."""
    if "popen" not in _memo:
        try:
            _memo["popen"] = run_popen_job(tmp_path_factory.mktemp("popen_job"))
        except BaseException as err:  # remember the failure: every test using the job reports it, none re-runs it
            _memo["popen"] = err
    if isinstance(_memo["popen"], BaseException):
        raise _memo["popen"]
    return _memo["popen"]
