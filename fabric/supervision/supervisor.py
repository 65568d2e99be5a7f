"""One supervisor for every way rank processes are started: start, watch, find the cause, stop, report.

``fabric run`` (ranks started from a command line), the popen launcher (rank 0 watching ranks
1..N-1 that re-run the script) and the multiprocessing launcher (spawn/fork workers) differ only in
how a rank process is made. Each hands :class:`Supervisor` a function that starts one rank and returns
a :class:`RankProcess` handle (its pid, ``poll()``, and the descriptors that become readable when it
ends or reports); everything else is decided here, once:

* **Watching** uses ``poll`` on pidfds / sentinels / status pipes (never ``select``, which breaks above
  descriptor 1023), so a waiting supervisor costs no CPU and wakes the moment a rank ends or reports.
* **The root cause**: a rank that ended without raising (a signal, ``os._exit``, ``sys.exit(n)``) is
  blamed before ranks that raised, because its peers' errors ("connection closed by peer") are echoes
  of its death; a rank that ended with status 0 before the first exception is blamed too (its peers
  lost it mid-job); among ranks that raised, the one that raised first is the cause. A rank reports
  ``sys.exit(n)`` as it begins its exit (see ``rank_side.report_exit``), before its interpreter
  shutdown closes its connections, so its peers' echoes never come first. When only exceptions are
  known, the supervisor listens :data:`SETTLE_S` longer for a death before it decides.
* **The diagnosis** of a collective timeout (which rank never arrived, and where each one was) is
  made before any rank is stopped, while the stuck ones can still be asked for their stacks.
* **Stopping**: SIGTERM to every rank's process group, :data:`GRACE_S` seconds, then SIGKILL.
* **Pre-emption warnings** are passed on to the ranks where a :class:`SignalForwarding` is given.
* **Rank states**: each rank is :class:`RankState` ``RUNNING``, ``SUCCEEDED``, ``RAISED`` or ``DIED``
  (:func:`rank_state`); a job has failed as soon as one rank has ``RAISED`` or ``DIED``.
* **Results are data**: :meth:`Supervisor.wait` returns a :class:`JobResult` (nothing failed, which
  rank failed and how, or which signal the supervisor was asked to stop for); the caller decides
  what to do: exit with its status, raise :class:`RankFailedError`, or start the ranks again.

Only the standard library is used, so importing this module is cheap (``fabric run`` imports it).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Protocol

from fabric._core.processes import kill_process_groups, signal_name
from fabric.supervision.diagnosis import (
    create_job_dir,
    diagnose,
    read_failures,
    reads_like_a_closed_connection,
    reads_like_a_lost_peer,
    remove_job_dir,
)
from fabric.supervision.failure_report import failure_report, read_briefs
from fabric.supervision.signals import SignalForwarding, SignalPipe
from fabric.supervision.step_watch import StepWatchReader, describe_stall

__all__ = [
    "GRACE_S",
    "POLL_S",
    "SETTLE_S",
    "JobResult",
    "RankFailedError",
    "RankFailure",
    "RankProcess",
    "RankState",
    "Supervisor",
    "describe_exit",
    "only_in_this_process",
    "rank_state",
]

#: Seconds the ranks get between SIGTERM and SIGKILL when the job is stopped.
GRACE_S = 1.5
#: The longest a supervisor sleeps between two looks at its ranks (it wakes earlier on any news).
POLL_S = 0.1
#: After a rank reports an exception, how long to look for a peer that died abruptly (the likelier
#: root cause) before blaming the rank that raised.
SETTLE_S = 0.25
#: Before the one report of a rank that raised: how long the other live ranks get to raise too (the same error on
#: every rank, e.g. a checkpoint that fits no rank, is one report naming them all); it ends as soon as each has.
REPORT_GATHER_S = 0.5
#: The same when the exception reads like a peer's closed connection ("connection reset by peer"): a peer is
#: ending, and on a loaded machine its end can be seen later than its closed sockets; the wait ends as soon as a
#: peer is seen ended.
LOST_PEER_SETTLE_S = 5.0


def describe_exit(rank: int, exitcode: int | None, *, raised: bool = False) -> str:
    """One sentence about how a rank ended, e.g. ``rank 1 was killed by SIGKILL``.

    ``exitcode`` follows the ``subprocess``/``multiprocessing`` convention: a negative number is the
    signal that killed the process.
    """
    if raised:
        detail = f" (exit code {exitcode})" if exitcode is not None and exitcode > 0 else ""
        return f"rank {rank} raised an exception{detail}"
    if exitcode is None:
        return f"rank {rank} failed"
    if exitcode < 0:
        return f"rank {rank} was killed by {signal_name(-exitcode)}"
    if exitcode == 0:
        return f"rank {rank} exited with code 0 while the other ranks still ran"
    return f"rank {rank} exited with code {exitcode}"


class RankFailedError(RuntimeError):
    """A rank of the job failed; carries which one, how, and its traceback text."""

    def __init__(
        self, rank: int, exitcode: int | None, traceback_text: str | None = None, diagnosis: str | None = None,
        report: str | None = None,
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        #: the failed rank's whole traceback (where it raised)
        self.traceback_text = traceback_text
        #: for a collective timeout: which ranks did not arrive and where every rank was
        self.diagnosis = diagnosis
        #: the job's one report of the failure (``Supervisor.failure_report``): the message, where given
        self.report = report
        message = describe_exit(rank, exitcode, raised=traceback_text is not None)
        if report:
            message = report
        elif traceback_text:
            message = f"{message}:\n{traceback_text.rstrip()}"
        if diagnosis:
            message = f"{message}\n{diagnosis}"
        super().__init__(message)

    @property
    def exit_status(self) -> int:
        """The status a job that ends with this failure exits with, as under ``fabric-torch run`` (see
        :attr:`JobResult.exit_status`): 1 for a rank that raised, n for ``sys.exit(n)``, 128 + N for signal N."""
        failure = RankFailure(self.rank, None, self.exitcode, raised=self.traceback_text is not None)
        return JobResult(failure=failure).exit_status

    def __reduce__(self) -> tuple[type, tuple[int, int | None, str | None, str | None, str | None]]:
        return (type(self), (self.rank, self.exitcode, self.traceback_text, self.diagnosis, self.report))


class RankProcess(Protocol):
    """What the supervisor needs of one rank process, however it was started."""

    rank: int
    #: ``time.monotonic()`` when the rank reported that it raised; None while it has not.
    raised_at: float | None
    #: the rank-labelled traceback it sent, where the way of starting it carries one
    traceback: str | None

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None:
        """The exit code once the process ended (negative: killed by that signal), else None."""

    def fds(self) -> list[int]:
        """Descriptors that become readable when the process ends or has something to report."""

    def take_reports(self, ready: Collection[int]) -> None:
        """Read what arrived on the descriptors in ``ready`` (never blocks)."""

    def close(self) -> None:
        """Release the descriptors; the process itself is left alone."""


class RankState(Enum):
    """Where a rank stands, as its supervisor sees it (:func:`rank_state`).

    ``RAISED`` wins over the exit code: a rank that reported an exception has failed whether it is still
    unwinding, already ended, or even ended with code 0. Whether its process still runs is a separate
    question (:meth:`Supervisor.alive`): a rank that raised may be alive for a while yet.
    """

    #: not ended, and no exception reported
    RUNNING = "running"
    #: ended with exit code 0 without reporting an exception
    SUCCEEDED = "succeeded"
    #: reported an exception (see ``RankProcess.raised_at``), ended or not
    RAISED = "raised"
    #: ended with a non-zero code or killed by a signal, without reporting an exception: the likelier
    #: root cause of a failure (see the module's rule)
    DIED = "died"

    @property
    def failed(self) -> bool:
        return self is RankState.RAISED or self is RankState.DIED


def rank_state(handle: RankProcess, exitcode: int | None) -> RankState:
    """The state of the rank behind ``handle``, whose ``poll()`` just returned ``exitcode``.

    Poll first: a handle may take in the rank's last report (its ``raised_at``) while it is polled.
    """
    if handle.raised_at is not None:
        return RankState.RAISED
    if exitcode is None:
        return RankState.RUNNING
    return RankState.SUCCEEDED if exitcode == 0 else RankState.DIED


def reported_exit(handle: RankProcess) -> tuple[int | None, float] | None:
    """``(status, when)`` a rank reported as it began to exit (status None: not known), or None.

    Only some handles carry it (``exiting``: a command's rank reports ``sys.exit(n)`` on its status pipe).
    """
    exiting = getattr(handle, "exiting", None)
    return exiting if isinstance(exiting, tuple) else None


def exit_code_of(handle: RankProcess) -> int | None:
    """The rank's exit code; the status it reported for ``sys.exit(n)`` while it is still exiting, or when
    the stop's signal cut its exit short (its status is its own, not our SIGTERM's)."""
    code = handle.poll()
    reported = reported_exit(handle)
    if reported is not None and reported[0] is not None and (code is None or code < 0):
        return reported[0]
    return code


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed."""

    rank: int
    pid: int | None
    exitcode: int | None
    raised: bool
    #: the rank's whole traceback, where its handle carries one (a multiprocessing worker sends it)
    traceback: str | None = None


@dataclass(frozen=True)
class JobResult:
    """How a job (one attempt of it) ended: every rank succeeded, one failed first, or a signal stopped it."""

    failure: RankFailure | None = None
    signal: int | None = None
    #: for a collective timeout: which ranks never arrived, and where every rank was
    diagnosis: str | None = None
    #: why an outside condition ended the attempt (see ``should_stop`` of :meth:`Supervisor.wait`),
    #: e.g. another node of the job restarting
    stopped: str | None = None
    #: a pre-emption warning passed on to the ranks before the end (see ``signals``)
    forwarded: int | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.signal is None and self.stopped is None

    @property
    def restartable(self) -> bool:
        """A rank failed on its own: neither a signal nor a pre-emption warning ended the attempt."""
        return self.failure is not None and self.signal is None and self.forwarded is None

    @property
    def exit_status(self) -> int:
        """The status a command ends with: 0, the failed rank's own status, 128 + the signal, or 1 when stopped.

        A rank that raised ends with 1 (Python's status for an uncaught exception) even when the
        supervisor's stop killed it while it unwound: its status is its exception's, not our SIGTERM's
        (a scheduler that requeues on 143 must not take a crash for a pre-emption).
        """
        if self.signal is not None:
            return 128 + self.signal
        if self.failure is None:
            return 0 if self.stopped is None else 1
        code = self.failure.exitcode
        if self.failure.raised:
            return code if code is not None and code > 0 else 1
        if code is None or code == 0:
            return 1
        return 128 - code if code < 0 else code


def only_in_this_process(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """A signal handler that acts only in the process that installed it.

    A forked copy (a DataLoader worker, a fork-started rank before it resets its handlers) inherits
    the handler but must not act for the job: there the signal gets its default action instead.
    """
    owner = os.getpid()

    def handle(signum: int, frame: Any) -> Any:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return None
        return handler(signum, frame)

    return handle


def wait_readable(fds: Sequence[int], timeout: float) -> list[int]:
    """The descriptors in ``fds`` that are readable, waiting up to ``timeout`` seconds."""
    if not fds:
        time.sleep(timeout)
        return []
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        events = poller.poll(int(timeout * 1000))
    except (OSError, ValueError, AttributeError):  # AttributeError: no poll() on Windows
        time.sleep(timeout)
        return []
    return [fd for fd, _ in events]


class Supervisor:
    """The ranks of one node's job: start them, watch them, find the root cause, stop them.

    Args:
        start_rank: starts the process of global rank ``rank`` and returns its handle; it is given the
            job folder (for :data:`~fabric._core.env.JOB_DIR_ENV`) as second argument.
        ranks: the global ranks this supervisor starts.
        own_rank: the rank of the calling process when it is itself one (rank 0 under popen): its
            stack then appears in a diagnosis.
        signals: signals that end :meth:`wait` with ``JobResult(signal=...)``.
        forwarding: passes pre-emption warnings among ``signals`` on to the ranks instead (``fabric run``).

    ``run()`` is start, wait, stop; calling it again starts every rank anew, which is where restarts
    live. :meth:`stop` may be called from another thread while :meth:`wait` runs: ``wait`` then
    returns the first rank that died as the failure.
    """

    def __init__(
        self,
        start_rank: Callable[[int, str], RankProcess],
        ranks: Sequence[int],
        own_rank: int | None = None,
        signals: SignalPipe | None = None,
        forwarding: SignalForwarding | None = None,
    ) -> None:
        self._start_rank = start_rank
        self.rank_ids = list(ranks)
        self.own_rank = own_rank
        self.signals = signals
        self.forwarding = forwarding
        #: the folder for the ranks' tracebacks and stacks, one per attempt (made by :meth:`start`)
        self.job_dir: str | None = None
        self.ranks: list[RankProcess] = []
        #: how many times :meth:`start` has started the ranks (0 before the first start)
        self.attempts = 0
        self._ended_at: dict[int, float] = {}
        self._lock = threading.Lock()
        self._steps = StepWatchReader(None)
        #: the highest committed step count a rank reported over every attempt (``step_watch``)
        self.committed_steps = 0

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank (a fresh attempt); if one cannot be started, stop those that were."""
        self.close()
        job_dir = self.job_dir = create_job_dir()
        self.ranks, self._ended_at = [], {}
        self._steps = StepWatchReader(job_dir)
        self.attempts += 1
        if self.forwarding is not None:
            self.forwarding.reset()
        try:
            for rank in self.rank_ids:
                self.ranks.append(self._start_rank(rank, job_dir))
        except BaseException:
            self.stop()
            self.close()
            raise

    def run(
        self, report: Callable[[str], object] | None = None, should_stop: Callable[[], JobResult | None] | None = None
    ) -> JobResult:
        """Start the ranks, wait for the job's end, and stop whatever is left; the result says how it went.

        ``report`` (e.g. a print to stderr) is told why the job is being stopped, before it is: the
        failed rank and how it ended, the signal, or why ``should_stop`` (see :meth:`wait`) ended it,
        and the diagnosis of a collective timeout. A signal is passed on to the ranks (Ctrl-C reaches
        them as a KeyboardInterrupt).
        """
        self.start()
        result = JobResult()
        try:
            result = self.wait(should_stop)
            if report is not None:
                others = self.others_alive(None)
                if result.failure is not None:
                    if result.failure.raised:
                        self._let_the_others_raise(REPORT_GATHER_S)
                    report(self.failure_report(result.failure, {handle.rank for handle in self.alive()}))
                elif result.signal is not None:
                    why = self.forwarding.stop_reason(result.signal) if self.forwarding else f"received {signal_name(result.signal)}"
                    report(f"{why}; stopping {others} rank(s) on this node")
                elif result.stopped is not None:
                    report(f"{result.stopped}; stopping {others} rank(s) on this node")
                if result.diagnosis:
                    report(result.diagnosis)
        finally:
            self.stop(result.signal or signal.SIGTERM)
        if result.failure is not None:  # now that it is stopped, its exit code is known (see exit_status)
            handle = self.rank(result.failure.rank)
            result = replace(result, failure=replace(result.failure, exitcode=exit_code_of(handle)))
        return result

    def wait(self, should_stop: Callable[[], JobResult | None] | None = None) -> JobResult:
        """Block until every rank succeeded, one failed (the root cause is returned), or a signal came.

        ``should_stop`` lets a condition outside this node end the wait: it is asked after each look
        at the ranks (about every :data:`POLL_S` seconds, so keep it cheap or let it throttle itself),
        and the first result it returns instead of None is returned as is, ranks still running.
        """
        forwarding = self.forwarding
        while True:
            signum = self.signals.take() if self.signals is not None else None
            # only running ranks are signalled: an ended (reaped) rank's pid may be someone else's by now
            if (
                signum is not None
                and forwarding is not None
                and not forwarding.stops_job(signum, [h.pid for h in self.alive() if h.pid is not None])
            ):
                signum = None
            forwarded = forwarding.forwarded if forwarding is not None else None
            if signum is not None:
                return JobResult(signal=signum, forwarded=forwarded)
            if any(state.failed for _, state in self._states()):
                cause = self.root_cause()
                assert cause is not None
                return JobResult(failure=self.failure_of(cause), diagnosis=self.diagnose(), forwarded=forwarded)
            if all(state is RankState.SUCCEEDED for _, state in self._states()):
                return JobResult(forwarded=forwarded)
            if forwarding is not None and forwarding.overdue():
                return JobResult(signal=signal.SIGTERM, forwarded=forwarded)
            stalled = self._end_a_stalled_rank()
            if stalled is not None:
                return replace(stalled, forwarded=forwarded)
            stopped = should_stop() if should_stop is not None else None
            if stopped is not None:
                return stopped
            self._watch(POLL_S)

    def stop(self, signum: int = signal.SIGTERM, grace: float = GRACE_S) -> None:
        """Send ``signum`` to every rank's process group; SIGKILL what is left after ``grace`` seconds."""
        pids = [handle.pid for handle in self.ranks if handle.pid is not None]
        kill_process_groups(pids, signum, grace, reap=self._exit_codes)

    def close(self) -> None:
        """Release descriptors and the job folder (call after :meth:`stop`)."""
        for handle in self.ranks:
            handle.close()
        self._steps.close(self.rank_ids)
        self.committed_steps = max(self.committed_steps, self._steps.committed)
        remove_job_dir(self.job_dir)
        self.job_dir = None

    # -- questions ----------------------------------------------------------------------------

    def rank(self, rank: int) -> RankProcess:
        return next(handle for handle in self.ranks if handle.rank == rank)

    def alive(self) -> list[RankProcess]:
        """The ranks whose process has not ended (a rank that raised may be among them, still unwinding)."""
        return [handle for handle, code in zip(self.ranks, self._exit_codes()) if code is None]

    def others_alive(self, rank: int | None) -> int:
        """How many ranks other than ``rank`` still run (a failed rank still unwinding is not one of its others)."""
        return sum(1 for handle in self.alive() if handle.rank != rank)

    def states(self) -> dict[int, RankState]:
        """Every started rank's :class:`RankState`, by rank, as of now."""
        return {handle.rank: state for handle, state in self._states()}

    def root_cause(self, settle: float = SETTLE_S, own_raised_at: float | None = None, own_trace: str | None = None) -> RankProcess | None:
        """The failed rank most likely at the root of the failure (see the module's rule), or None.

        The first rank to end is the cause: one that died (a non-zero status, reported or seen, or a
        signal) before any other, else one that ended with status 0 before the first exception, else the
        first to raise. ``own_raised_at``: when the calling process (a rank itself, not among
        :attr:`ranks`) raised; None (the calling rank) when it was first.
        """
        start = time.monotonic()
        deadline = start + settle
        while True:
            # one poll per round: a rank that ends between two polls would be "not alive" yet not "died"
            codes = self._exit_codes()
            states = self._states(codes)
            died = [handle for handle, state in states if self._died(handle, state)]
            if not died and self._echoes_a_lost_peer(states, own_trace):
                if any(state is RankState.SUCCEEDED or reported_exit(handle) is not None for handle, state in states):
                    break  # the peer whose loss the exception reads as is seen ended
                deadline = max(deadline, start + LOST_PEER_SETTLE_S)
            remaining = deadline - time.monotonic()
            if died or remaining <= 0 or all(code is not None for code in codes):
                break
            self._watch(min(remaining, POLL_S))
        if died:
            return min(died, key=lambda handle: (self._end_time(handle), handle.rank))
        raised = [handle for handle, state in states if state is RankState.RAISED]
        first = min(raised, key=lambda handle: (handle.raised_at, handle.rank)) if raised else None
        raise_times = [t for t in (first.raised_at if first is not None else None, own_raised_at) if t is not None]
        if not raise_times:
            return None
        own_first = first is None or (own_raised_at is not None and own_raised_at < (first.raised_at or 0.0))
        # a rank that finished (status 0) before the first exception is its cause only when that exception
        # reads as a lost peer ("connection closed by peer"): a rank may well finish its work before another raises
        first_trace = own_trace if own_first else self._trace_of(first)
        if first_trace is None or reads_like_a_lost_peer(first_trace):
            early = [handle for handle, state in states if state is not RankState.RAISED and self._end_time(handle) < min(raise_times)]
            if early:
                return min(early, key=lambda handle: (self._end_time(handle), handle.rank))
        return None if own_first else first  # None: the calling rank raised first

    def _echoes_a_lost_peer(self, states: list[tuple[RankProcess, RankState]], own_trace: str | None) -> bool:
        """Whether the exceptions known so far read like a peer's closed connection (the echo of another rank's end)."""
        traces = [own_trace, *(self._trace_of(handle) for handle, state in states if state is RankState.RAISED)]
        return any(trace is not None and reads_like_a_closed_connection(trace) for trace in traces)

    def _trace_of(self, handle: RankProcess | None) -> str | None:
        """The traceback ``handle``'s rank sent or recorded in the job folder (None: not known)."""
        if handle is None:
            return None
        return handle.traceback or read_failures(self.job_dir).get(handle.rank)

    @staticmethod
    def _died(handle: RankProcess, state: RankState) -> bool:
        if state is RankState.DIED:
            return True
        reported = reported_exit(handle)
        return state is RankState.RUNNING and reported is not None and reported[0] not in (None, 0)

    def _end_time(self, handle: RankProcess) -> float:
        """When the rank began to exit (its own report) or was seen ended; infinity while it runs."""
        reported = reported_exit(handle)
        if reported is not None:
            return reported[1]
        return self._ended_at.get(handle.rank, float("inf"))

    def failure_report(
        self, failure: RankFailure, running: Collection[int], own_brief: str | None = None, with_pids: bool = True
    ) -> str:
        """The one report of ``failure`` (see ``failure_report``): the cause, with every rank that raised the same,
        its brief traceback, and how many of the ``running`` ranks are stopped besides. ``own_brief``: the brief
        traceback of the calling process, a rank itself (:attr:`own_rank`), where it raised; ``with_pids``: name
        the failed ranks' pids (not in an exception's message)."""
        briefs = read_briefs(self.job_dir)
        pids = {handle.rank: handle.pid for handle in self.ranks}
        if self.own_rank is not None:
            pids[self.own_rank] = os.getpid()
            if own_brief is not None:
                briefs[self.own_rank] = own_brief
        described = describe_exit(failure.rank, failure.exitcode, raised=failure.raised)
        return failure_report(failure.rank, failure.raised, described, briefs, pids if with_pids else None, running, failure.traceback)

    def failure_of(self, handle: RankProcess) -> RankFailure:
        return RankFailure(handle.rank, handle.pid, exit_code_of(handle), handle.raised_at is not None, handle.traceback)

    def diagnose(self, own_trace: str | None = None, own_running: bool = True) -> str | None:
        """For a collective timeout: which ranks did not arrive and where each one was (else None).

        When the calling process is a rank (``own_rank``): ``own_trace`` is its traceback if it raised;
        ``own_running`` says whether it is still training (its stack is then part of the picture).
        """
        live = {h.rank: h.pid for h, state in self._states() if state is RankState.RUNNING and h.pid is not None}
        raised = {h.rank: h.traceback for h in self.ranks if h.traceback is not None}
        own = self.own_rank
        if own is not None and own_trace is not None:
            raised[own] = own_trace
        elif own is not None and own_running:
            live[own] = os.getpid()
        try:
            return diagnose(self.job_dir, live, raised, own_rank=own if own in live else None)
        except Exception as err:  # a diagnosis must never stand in the way of the teardown
            return f"fabric: could not diagnose the failure ({type(err).__name__}: {err})"

    # -- internals ------------------------------------------------------------------------------

    def _let_the_others_raise(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every rank still running has raised too, or ended."""
        deadline = time.monotonic() + timeout
        while any(state is RankState.RUNNING for _, state in self._states()) and time.monotonic() < deadline:
            self._watch(min(POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _end_a_stalled_rank(self) -> JobResult | None:
        """A rank whose step made no progress beyond its ``step_timeout`` (``step_watch``): ended at once with SIGKILL
        (a hung rank may never act on SIGTERM), after its stack was asked for; the report says where it was."""
        running = {h.rank: h.pid for h, state in self._states() if state is RankState.RUNNING and h.pid is not None}
        stall = self._steps.look(running)
        if stall is None:
            return None
        handle = self.rank(stall.rank)
        report = describe_stall(stall, self._steps.where(stall, running[stall.rank]))
        kill_process_groups([running[stall.rank]], signal.SIGKILL, GRACE_S, reap=self._exit_codes)
        return JobResult(failure=self.failure_of(handle), diagnosis=report)

    def _exit_codes(self) -> list[int | None]:
        codes = [handle.poll() for handle in self.ranks]
        now = time.monotonic()
        for handle, code in zip(self.ranks, codes):
            if code is not None:
                self._ended_at.setdefault(handle.rank, now)
        return codes

    def _states(self, codes: list[int | None] | None = None) -> list[tuple[RankProcess, RankState]]:
        """Each rank with its state; every rank is polled (or ``codes`` were) before any ``raised_at`` is read."""
        codes = self._exit_codes() if codes is None else codes
        return [(handle, rank_state(handle, code)) for handle, code in zip(self.ranks, codes)]

    def _watch(self, timeout: float) -> None:
        """Sleep until a rank ends or reports, a signal arrives, or ``timeout`` passes; take the news in."""
        fds = [fd for handle in self.ranks for fd in handle.fds()]
        if self.signals is not None and self.signals.fd is not None:
            fds.append(self.signals.fd)
        ready = set(wait_readable(fds, timeout))
        with self._lock:
            for handle in self.ranks:
                handle.take_reports(ready)
