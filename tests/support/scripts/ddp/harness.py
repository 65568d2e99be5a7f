"""Running the real 2-process DDP jobs from the test process, with hard timeouts.

A job's results are memoized per test session, so several test files can assert on one job without
paying for its processes twice (each job costs seconds of torch imports).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from support.environment import job_environment

SCRIPTS = Path(__file__).resolve().parent

_memo: dict[str, Any] = {}


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
