"""A rank that never joins a collective: the job ends within 15 s, naming the rank and where it was.

``support/scripts/resilience/stuck.py`` runs a real 2-rank gloo job with ``DDPStrategy(timeout=10 s)`` in
which one rank sleeps (or spins in pure Python) instead of joining an all-reduce. The six jobs
(popen and spawn; rank 1 or rank 0 stuck; with and without a launched function) run concurrently:
each one mostly waits out its 10 s timeout, so together they cost about as much as one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.environment import job_environment
from support.loading import script_path
from support.processes import alive

if not sys.platform.startswith("linux"):
    pytest.skip("the stuck-rank tests inspect /proc", allow_module_level=True)

SCRIPT = script_path("resilience", "stuck.py")

TIMEOUT_S = 10.0  # the process group's timeout the script sets
PROMISE_S = 15.0  # the job is over this long after the waiting rank entered the collective

SCENARIOS = {
    "popen-rank1-sleeps": ["--start-method", "popen", "--stuck", "1", "--how", "sleep"],
    "popen-rank1-sleeps-launched-function": ["--start-method", "popen", "--stuck", "1", "--how", "sleep", "--with-function"],
    "popen-rank0-sleeps": ["--start-method", "popen", "--stuck", "0", "--how", "sleep"],
    "popen-rank0-spins-launched-function": ["--start-method", "popen", "--stuck", "0", "--how", "spin", "--with-function"],
    "spawn-rank1-sleeps": ["--start-method", "spawn", "--stuck", "1", "--how", "sleep"],
    "spawn-rank0-sleeps": ["--start-method", "spawn", "--stuck", "0", "--how", "sleep"],
}


def _marked_line(marker: str) -> int:
    for number, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if marker in line:
            return number
    raise AssertionError(f"no line marked {marker} in {SCRIPT}")


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (each job's folder is in its argv)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


class StuckJob:
    def __init__(self, name: str, outdir: Path, proc: subprocess.Popen) -> None:
        self.name, self.outdir, self.proc = name, outdir, proc
        self.end: float | None = None  # when the job's last process was seen gone

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.outdir.glob("pid*") if p.read_text().strip()]

    def finished(self) -> bool:
        if self.end is None and self.proc.poll() is not None and not any(alive(p) for p in self.pids()):
            self.end = time.time()
        return self.end is not None

    @property
    def stderr(self) -> str:
        return (self.outdir / "stderr.txt").read_text(errors="replace")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Start every scenario at once; wait (at most 150 s) until each job is completely gone."""
    started: dict[str, StuckJob] = {}
    try:
        for name, args in SCENARIOS.items():
            outdir = tmp_path_factory.mktemp(name)
            with open(outdir / "stderr.txt", "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(SCRIPT), str(outdir), *args],
                    cwd=outdir,
                    env=job_environment(),
                    stdout=err,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            started[name] = StuckJob(name, outdir, proc)
        deadline = time.monotonic() + 150
        while not all(job.finished() for job in started.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield started
    finally:
        for job in started.values():  # whatever a failing test left behind
            for pid in [job.proc.pid, *job.pids(), *_processes_mentioning(str(job.outdir))]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            job.proc.wait()


@pytest.mark.procs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_stuck_rank_is_named_and_the_job_ends(jobs, name):
    job = jobs[name]
    args = SCENARIOS[name]
    stuck = int(args[args.index("--stuck") + 1])
    waiting = 1 - stuck
    how = args[args.index("--how") + 1]
    assert job.finished(), f"{name}: the job did not end\n{job.stderr[-4000:]}"

    assert job.proc.returncode != 0, job.stderr[-4000:]
    enter_file = job.outdir / f"enter{waiting}"
    assert enter_file.exists(), f"rank {waiting} never reached the collective\n{job.stderr[-4000:]}"
    assert not (job.outdir / f"left{waiting}").exists()
    elapsed = job.end - float(enter_file.read_text())
    assert TIMEOUT_S - 0.5 <= elapsed <= PROMISE_S, f"{name}: the job ended {elapsed:.1f}s after the collective began"

    line = _marked_line("STUCK-SLEEP" if how == "sleep" else "STUCK-SPIN")
    expected = (
        f"fabric: rank {stuck} did not arrive at the collective; it was at {SCRIPT}:{line} in stuck_forever"
    )
    assert expected in job.stderr, job.stderr[-4000:]
    assert re.search(rf"fabric: rank {waiting} waited in the collective and timed out at .*stuck\.py:\d+ in train", job.stderr)
    assert job.stderr.count("did not arrive") == 1  # reported once, and only the stuck rank

    assert len(job.pids()) == 2
    assert not [p for p in job.pids() if alive(p)]
    assert _processes_mentioning(str(job.outdir)) == [], "a process of the job survived"


# ---- the pieces, in this process ------------------------------------------------------------------

import torch  # noqa: E402

from fabric.supervision import diagnosis  # noqa: E402

pytestmark = [pytest.mark.timing, pytest.mark.cold]

TORCH_DIR = os.path.dirname(torch.__file__)
GLOO_TIMEOUT = f'''Traceback (most recent call last):
  File "/home/me/train.py", line 30, in main
    fabric.all_reduce(x)
  File "{TORCH_DIR}/distributed/distributed_c10d.py", line 3252, in all_reduce
    work.wait()
RuntimeError: [third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete
'''


def test_collective_timeouts_are_told_from_other_errors():
    assert diagnosis.looks_like_collective_timeout(GLOO_TIMEOUT)
    assert not diagnosis.looks_like_collective_timeout(GLOO_TIMEOUT.replace("Timed out waiting 10000ms for", "bad"))
    assert not diagnosis.looks_like_collective_timeout('File "train.py", line 3\nTimeoutError: the user\'s own timeout')
    # no timeout among the failures: no diagnosis (and no rank is asked for its stack)
    assert diagnosis.diagnose(None, {1: os.getpid()}, {0: "ValueError: bad batch"}) is None


def test_a_rank_is_asked_for_its_stack_and_placed(tmp_path):
    """Register the dump handler here, signal ourselves, and find this very function in the answer."""
    previous = signal.getsignal(diagnosis.DUMP_SIGNAL)
    try:
        assert diagnosis.install_stack_dump(str(tmp_path), 3)
        stacks = diagnosis._collect_stacks(str(tmp_path), {3: os.getpid()}, wait=5.0)
        frames = stacks[3]
        here = [f for f in frames if f.function == "test_a_rank_is_asked_for_its_stack_and_placed"]
        assert here and here[0].filename == __file__
        assert not diagnosis._in_collective(frames)
        report = diagnosis._format([diagnosis._RankReport(3, "absent", frames), diagnosis._RankReport(0, "raised", diagnosis._traceback_frames(GLOO_TIMEOUT))])
        assert report.splitlines()[0].startswith("fabric: rank 3 did not arrive at the collective; it was at ")
        assert "/home/me/train.py:30 in main" in report.splitlines()[1]
    finally:
        import faulthandler

        faulthandler.unregister(diagnosis.DUMP_SIGNAL)
        signal.signal(diagnosis.DUMP_SIGNAL, previous)
        if diagnosis._dump_file is not None:
            diagnosis._dump_file.close()
            diagnosis._dump_file = None


@pytest.mark.procs
def test_a_rank_that_never_registered_is_not_signalled(tmp_path):
    # the default action of the signal would kill it: without its header line nobody sends it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert diagnosis._collect_stacks(str(tmp_path), {1: child.pid}, wait=0.3) == {}
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_the_source_shown_is_the_code_without_its_comment():
    assert diagnosis._without_comment("time.sleep(600)  # STUCK") == "time.sleep(600)"
    assert diagnosis._without_comment('x = "#not a comment"  # a comment') == 'x = "#not a comment"'
