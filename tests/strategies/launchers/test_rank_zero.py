"""Rank 0's supervision under popen, with its supervisor replaced by a scripted stand-in.

The stand-in makes the timing deterministic: it reports a failed child after a short delay and then
takes long to stop the others, the window in which rank 0's interpreter is already exiting.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from support import REPO
from support.environment import clean_env

pytestmark = [pytest.mark.procs, pytest.mark.cold]

if not sys.platform.startswith("linux"):
    pytest.skip("popen supervision is tested on Linux", allow_module_level=True)

_RANK_ZERO = textwrap.dedent(
    """
    import sys, time
    from fabric.supervision.rank_zero import RankZeroSupervision
    from fabric.supervision.supervisor import JobResult, RankFailure, Supervisor

    class SlowToStop(Supervisor):
        def __init__(self):
            super().__init__(start_rank=None, ranks=[], own_rank=0)

        def wait(self):
            time.sleep({report_after})
            return JobResult(failure=RankFailure(1, None, 1, True))

        def stop(self, signum=15):
            time.sleep({stop_takes})

        def close(self):
            pass

    RankZeroSupervision(SlowToStop()).start()
    print("rank 0 returned", flush=True)
    """
)


@pytest.mark.timeout(30)
def test_a_child_failure_seen_while_rank0_exits_fails_the_job_even_if_stopping_takes_long() -> None:
    """Rank 0 already returned and sits in its exit hook; the child's failure must still decide the status."""
    code = _RANK_ZERO.format(report_after=0.3, stop_takes=1.5)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=25
    )
    assert "rank 0 returned" in proc.stdout
    assert proc.returncode == 1, proc.stderr
    assert "[fabric] rank 1 raised an exception" in proc.stderr
