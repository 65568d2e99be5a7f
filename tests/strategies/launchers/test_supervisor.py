"""The one supervisor, driven directly: real rank processes started from command lines.

Each rank here is a few lines of Python run through ``CommandRank`` (the handle ``fabric run`` and the
popen launcher use). A rank "raises" the way a supervised rank does: it writes its report to the
status pipe named in ``FABRIC_STATUS_FD``.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time

import pytest

from fabric.supervision.command_rank import CommandRank
from fabric.supervision.signals import SignalPipe
from fabric.supervision.supervisor import JobResult, RankFailure, RankState, Supervisor, rank_state
from support import REPO

pytestmark = pytest.mark.cold

if not sys.platform.startswith("linux"):
    pytest.skip("the supervisor tests use pidfds and /proc", allow_module_level=True)

# What each rank runs, by name; {delay} is filled in per test.
_BODIES = {
    "ok": "import time; time.sleep({delay})",
    "exit3": "import time, sys; time.sleep({delay}); sys.exit(3)",
    "sigkill": "import os, signal, time; time.sleep({delay}); os.kill(os.getpid(), signal.SIGKILL)",
    # report "I raised" as a supervised rank's excepthook does, then end like an uncaught exception
    "raise": (
        "import os, sys, time; time.sleep({delay}); fd = int(os.environ['FABRIC_STATUS_FD']);"
        " os.write(fd, ('E%.6f\\n' % time.monotonic()).encode()); sys.exit(1)"
    ),
    # report "I raised", then keep unwinding (a slow interpreter shutdown): still running when the job is stopped
    "raise_slowly": (
        "import os, time; time.sleep({delay}); fd = int(os.environ['FABRIC_STATUS_FD']);"
        " os.write(fd, ('E%.6f\\n' % time.monotonic()).encode()); time.sleep(60)"
    ),
    "sleep": "import time; time.sleep(60)",
    # report "I exit with N" as a supervised rank's sys.exit does, then a slow shutdown (leaving the group)
    "exit3_slowly": (
        "import os, time; time.sleep({delay}); fd = int(os.environ['FABRIC_STATUS_FD']);"
        " os.write(fd, ('X3 %.6f\\n' % time.monotonic()).encode()); time.sleep(60)"
    ),
    # record a traceback in the job folder as a supervised rank's excepthook does (text: {text}), report it, end
    "raise_recorded": (
        "import os, sys, time; sys.path.insert(0, {repo!r}); from fabric.supervision.diagnosis import record_failure;"
        " time.sleep({delay}); record_failure(os.environ['FABRIC_JOB_DIR'], {rank}, {text!r});"
        " fd = int(os.environ['FABRIC_STATUS_FD']); os.write(fd, ('E%.6f\\n' % time.monotonic()).encode()); sys.exit(1)"
    ),
    "exit0_reported": (
        "import os, time; time.sleep({delay}); fd = int(os.environ['FABRIC_STATUS_FD']);"
        " os.write(fd, ('X0 %.6f\\n' % time.monotonic()).encode())"
    ),
}


def _supervisor(plan: dict[int, tuple[str, float]], texts: dict[int, str] | None = None, **kwargs) -> Supervisor:
    texts = texts or {}

    def start_rank(rank: int, job_dir: str) -> CommandRank:
        body, delay = plan[rank]
        text = texts.get(rank, "")
        command = [sys.executable, "-c", _BODIES[body].format(delay=delay, rank=rank, repo=str(REPO), text=text)]
        return CommandRank(rank, command, dict(os.environ), job_dir)

    return Supervisor(start_rank, sorted(plan), **kwargs)


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_clean_job_and_a_failed_one_are_results_and_the_job_can_run_again() -> None:
    plan = {0: ("ok", 0.0), 1: ("ok", 0.3)}
    supervisor = _supervisor(plan)
    assert supervisor.run() == JobResult() and supervisor.attempts == 1
    # the same supervisor starts every rank anew: the place where restarts live
    first_pids = [handle.pid for handle in supervisor.ranks]
    plan.update({0: ("sleep", 0), 1: ("exit3", 0.2), 2: ("sleep", 0)})
    supervisor.rank_ids = [0, 1, 2]
    started = time.monotonic()
    result = supervisor.run()
    assert time.monotonic() - started < 10  # the sleeping ranks were stopped
    assert supervisor.attempts == 2
    assert result.failure is not None and result.failure.rank == 1 and result.failure.exitcode == 3
    assert not result.failure.raised and result.exit_status == 3
    said = supervisor.failure_report(result.failure, running=())  # how the job's report tells it
    assert said == f"rank 1 exited with code 3, pid {result.failure.pid}"
    assert not {handle.pid for handle in supervisor.ranks} & set(first_pids)
    assert not supervisor.alive()
    supervisor.close()
    assert supervisor.job_dir is None


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_rank_killed_outright_is_blamed_before_peers_that_raise_after_it() -> None:
    # rank 0 "raises" 0.1 s after rank 1 died: an echo of the death, like "connection closed by peer"
    result = _supervisor({0: ("raise", 0.6), 1: ("sigkill", 0.5), 2: ("sleep", 0)}).run()
    assert result.failure is not None and result.failure.rank == 1
    assert result.failure.exitcode == -signal.SIGKILL and result.exit_status == 128 + signal.SIGKILL


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_rank_that_reported_its_exit_status_is_the_cause_before_peers_that_raise_while_it_shuts_down() -> None:
    # rank 1 called sys.exit(3) and is still shutting down when rank 0 raises (its echo): rank 1, status 3,
    # also though the stop's SIGTERM ended its shutdown
    supervisor = _supervisor({0: ("raise", 0.8), 1: ("exit3_slowly", 0.3), 2: ("sleep", 0)})
    result = supervisor.run()
    assert result.failure is not None and result.failure.rank == 1 and not result.failure.raised
    assert result.failure.exitcode == 3 and result.exit_status == 3
    said = supervisor.failure_report(result.failure, running=())  # how the job's report tells it
    assert said == f"rank 1 exited with code 3, pid {result.failure.pid}"
    supervisor.close()


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_rank_that_ended_with_0_before_the_first_exception_is_the_cause_with_status_1() -> None:
    supervisor = _supervisor({0: ("raise", 0.8), 1: ("exit0_reported", 0.3), 2: ("sleep", 0)})
    result = supervisor.run()
    assert result.failure is not None and result.failure.rank == 1 and result.failure.exitcode == 0
    assert result.exit_status == 1
    assert supervisor.failure_report(result.failure, running=()).startswith("rank 1 exited with code 0 while the other ranks still ran")
    supervisor.close()


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("ValueError: boom from rank 0", 0),  # the code's own error: rank 1 merely finished its work first
        ("torch.distributed.DistBackendError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer", 1),
    ],
)
def test_a_rank_that_finished_before_an_exception_is_its_cause_only_if_the_exception_is_a_lost_peer(text, cause) -> None:
    result = _supervisor({0: ("raise_recorded", 0.8), 1: ("ok", 0.2), 2: ("sleep", 0)}, texts={0: text}).run()
    assert result.failure is not None and result.failure.rank == cause
    assert result.exit_status == 1


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_among_ranks_that_raised_the_first_is_the_cause() -> None:
    result = _supervisor({0: ("raise", 0.8), 1: ("raise", 0.5), 2: ("sleep", 0)}).run()
    assert result.failure is not None and result.failure.rank == 1 and result.failure.raised
    assert result.exit_status == 1


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_rank_stopped_while_it_unwinds_its_exception_gives_status_1_and_is_not_counted_among_the_others() -> None:
    reports: list[str] = []
    supervisor = _supervisor({0: ("sleep", 0), 1: ("raise_slowly", 0.3)})
    result = supervisor.run(report=reports.append)
    supervisor.close()
    assert result.failure is not None and result.failure.rank == 1 and result.failure.raised
    assert result.failure.exitcode == -signal.SIGTERM  # the supervisor's stop ended it ...
    assert result.exit_status == 1  # ... but the job's status is its exception's, not 143
    assert len(reports) == 1 and reports[0].endswith("; stopping the other 1 rank(s) on this node"), reports


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_signal_ends_the_wait_and_reaches_the_ranks() -> None:
    previous = signal.signal(signal.SIGUSR2, lambda *_: None)
    signals = SignalPipe([signal.SIGUSR2])
    try:
        supervisor = _supervisor({0: ("sleep", 0), 1: ("sleep", 0)}, signals=signals)
        supervisor.start()
        os.kill(os.getpid(), signal.SIGUSR2)
        result = supervisor.wait()
        supervisor.stop()
    finally:
        signals.close()
        signal.signal(signal.SIGUSR2, previous)
    assert result.signal == signal.SIGUSR2 and result.exit_status == 128 + signal.SIGUSR2
    assert not supervisor.alive()
    supervisor.close()


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_an_outside_condition_ends_the_wait_with_its_own_result() -> None:
    """``should_stop`` (e.g. another node restarting) ends the attempt; its result comes back as it is."""
    asked = []

    def should_stop() -> JobResult | None:
        asked.append(time.monotonic())
        return JobResult(stopped="another node is restarting the job") if len(asked) >= 3 else None

    supervisor = _supervisor({0: ("sleep", 0), 1: ("sleep", 0)})
    reports: list[str] = []
    started = time.monotonic()
    result = supervisor.run(report=reports.append, should_stop=should_stop)
    assert time.monotonic() - started < 10  # the sleeping ranks were stopped
    assert result == JobResult(stopped="another node is restarting the job")
    assert not result.ok and result.exit_status == 1
    assert reports == ["another node is restarting the job; stopping 2 rank(s) on this node"]
    assert not supervisor.alive() and len(asked) == 3
    supervisor.close()
    # a job that ends by itself never asks for more, and its own result wins
    failing = _supervisor({0: ("exit3", 0.2)})
    assert failing.run(should_stop=lambda: None).failure.exitcode == 3
    failing.close()


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_descriptors_above_1023_are_watched() -> None:
    """``select`` cannot watch a descriptor above 1023; a big job (or a busy process) has them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        result = _supervisor({0: ("ok", 0.2), 1: ("exit3", 0.4)}).run()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert result.failure is not None and result.failure.rank == 1 and result.failure.exitcode == 3


def test_exit_status_of_each_kind_of_result() -> None:
    assert JobResult().ok and JobResult().exit_status == 0
    assert JobResult(signal=signal.SIGINT).exit_status == 130
    assert JobResult(failure=RankFailure(1, 10, -signal.SIGKILL, False)).exit_status == 137
    assert JobResult(failure=RankFailure(1, 10, 5, False)).exit_status == 5
    assert JobResult(failure=RankFailure(1, 10, None, True)).exit_status == 1  # raised, still shutting down
    # raised, then stopped by the supervisor's SIGTERM (or killed) while it unwound: its exception's status
    assert JobResult(failure=RankFailure(1, 10, -signal.SIGTERM, True)).exit_status == 1
    assert JobResult(failure=RankFailure(1, 10, -signal.SIGKILL, True)).exit_status == 1
    assert JobResult(failure=RankFailure(1, 10, 4, True)).exit_status == 4  # its own code, once it ended by itself
    assert JobResult(stopped="another node ended the job").exit_status == 1


class _Handle:
    """Just what ``rank_state`` reads of a rank handle."""

    def __init__(self, raised_at: float | None = None) -> None:
        self.raised_at = raised_at


def test_rank_states_follow_the_exit_code_unless_the_rank_raised() -> None:
    assert rank_state(_Handle(), None) is RankState.RUNNING
    assert rank_state(_Handle(), 0) is RankState.SUCCEEDED
    assert rank_state(_Handle(), 3) is RankState.DIED
    assert rank_state(_Handle(), -signal.SIGKILL) is RankState.DIED
    # a rank that reported an exception has failed, still unwinding or ended, whatever its code
    for code in (None, 0, 1):
        assert rank_state(_Handle(raised_at=1.0), code) is RankState.RAISED
    assert [state for state in RankState if state.failed] == [RankState.RAISED, RankState.DIED]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_the_supervisor_reports_each_ranks_state() -> None:
    supervisor = _supervisor({0: ("ok", 0.0), 1: ("exit3", 0.0), 2: ("raise", 0.0), 3: ("sleep", 0)})
    supervisor.start()
    try:
        deadline = time.monotonic() + 20
        while len(supervisor.alive()) > 1 and time.monotonic() < deadline:
            supervisor._watch(0.1)
        assert supervisor.states() == {
            0: RankState.SUCCEEDED,
            1: RankState.DIED,
            2: RankState.RAISED,
            3: RankState.RUNNING,
        }
    finally:
        supervisor.stop()
        supervisor.close()
    assert supervisor.states()[3] is RankState.DIED  # stopped by SIGTERM: not a rank that succeeded


class _EndsBetweenPolls:
    """A rank handle whose process is seen running at the first poll and ended with ``code`` at every later one."""

    def __init__(self, rank: int, code: int) -> None:
        self.rank, self.pid, self.raised_at, self.traceback = rank, 4242, None, None
        self._code, self.polls = code, 0

    def poll(self) -> int | None:
        self.polls += 1
        return None if self.polls == 1 else self._code

    def fds(self) -> list[int]:
        return []

    def take_reports(self, ready: object) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_rank_that_ends_while_the_cause_is_sought_is_the_cause_of_the_echo_in_the_calling_rank() -> None:
    # rank 0 (the caller) raised "connection reset by peer" because rank 1 did os._exit(5); rank 1 is still
    # running at the first poll and has ended by the next: it is the cause, whichever poll saw it end
    supervisor = Supervisor(lambda rank, job_dir: _EndsBetweenPolls(rank, 5), [1], own_rank=0)
    supervisor.ranks = [_EndsBetweenPolls(1, 5)]
    echo = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
    cause = supervisor.root_cause(own_raised_at=time.monotonic(), own_trace=echo)
    assert cause is supervisor.ranks[0]
