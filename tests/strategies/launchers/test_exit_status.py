"""A rank that ends mid-job with ``sys.exit(n)``, ``sys.exit(0)`` or ``os._exit(n)`` is the job's cause.

Its peers then fail in their next collective ("connection closed by peer"): echoes, never the cause. The
job ends with the first rank's own status and the one report line says how it ended, under
``fabric-torch run`` and under ``fabric.launch()`` (popen); under ``fabric.launch(fn)`` (spawn, fork) the
launcher's ``RankFailedError`` says it, and the program ends with the same status. Real 2-rank gloo jobs,
free ports, timeouts.
"""

from __future__ import annotations

import sys

import pytest

from support.environment import job_environment
from support.loading import script_path
from support.processes import fabric_run, run

pytestmark = [pytest.mark.procs, pytest.mark.cold]

if not sys.platform.startswith("linux"):
    pytest.skip("the supervisor uses pidfds", allow_module_level=True)

SCRIPT = script_path("resilience", "ends_mid_job.py")
IN_FUNCTION = script_path("resilience", "ends_mid_job_in_function.py")

CASES = [
    ("exit3", 3, "rank 1 exited with code 3, pid"),
    # a job whose rank left while others still needed it failed: status 1, and rank 1 is named
    ("exit0", 1, "rank 1 exited with code 0 while the other ranks still ran, pid"),
    ("os_exit5", 5, "rank 1 exited with code 5, pid"),
]


def _reports(stderr: str) -> list[str]:
    return [line[line.index("[fabric]"):] for line in stderr.splitlines() if "[fabric] " in line]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "status", "said"), CASES)
def test_under_fabric_run_the_first_rank_to_end_is_the_cause(how: str, status: int, said: str) -> None:
    result = run([*fabric_run("--devices", "2", SCRIPT, how)], timeout=80, env=job_environment(), check=False)
    reports = _reports(result.stderr)
    assert result.returncode == status, result.stderr
    assert len(reports) == 1 and said in reports[0], result.stderr
    assert "raised an exception" not in reports[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "status", "said"), CASES)
def test_under_launch_the_first_rank_to_end_is_the_cause(how: str, status: int, said: str) -> None:
    result = run([sys.executable, str(SCRIPT), how], timeout=80, env=job_environment(), check=False)
    reports = _reports(result.stderr)
    assert result.returncode == status, result.stderr
    assert len(reports) == 1 and said in reports[0], result.stderr
    assert "rank 0" not in reports[0].split(";")[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
@pytest.mark.parametrize(("how", "status", "said"), CASES)
def test_under_launch_of_a_function_the_first_rank_to_end_is_the_cause(strategy: str, how: str, status: int, said: str) -> None:
    result = run([sys.executable, str(IN_FUNCTION), how, strategy], timeout=80, env=job_environment(), check=False)
    # the launching process is no rank: the uncaught RankFailedError is the report, and the pid not part of it
    message = said.removesuffix(", pid")
    assert f"RankFailedError: {message}\n" in result.stderr, result.stderr
    assert "rank 0 raised" not in result.stderr
    assert result.returncode == status, result.stderr
