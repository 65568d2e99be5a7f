"""The popen job's supervision inside rank 0: the supervisor on a thread, plus hooks on the interpreter.

All decisions go through ``_lock`` and the ``_stopping`` and ``_reported`` flags so that the monitor thread,
the excepthook, the signal handlers and the atexit hook never report the same failure twice or fight over
the teardown. The report is the job's one report (``Supervisor.failure_report``): rank 0 prints no
traceback of its own, it leaves it in the job folder like any rank; Ctrl-C is one line. Every hook first
checks that it runs in the process that started the children: a fork of rank 0 (a DataLoader worker, say)
inherits the hooks but must never act for the job.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

from fabric._core.process_end import HARD_END_WAIT_S, run_process_end_callbacks
from fabric._core.processes import descendant_pids, flush_stdio, kill_processes, signal_name
from fabric.supervision.failure_report import brief_traceback, full_tracebacks
from fabric.supervision.rank_side import print_rank_exception, record_exception, write_stderr
from fabric.supervision.signals import SignalPipe
from fabric.supervision.supervisor import GRACE_S, POLL_S, JobResult, RankFailure, Supervisor, only_in_this_process

__all__ = ["RankZeroSupervision"]

# How long rank 0's main thread gets to unwind after Ctrl-C before it is ended hard.
_SIGINT_GRACE_S = 2.0


class RankZeroSupervision:
    """Runs inside rank 0 and ends the whole job when any part of it fails."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.rank = supervisor.own_rank if supervisor.own_rank is not None else 0
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._stopping = False
        #: whether the job's failure (or the signal that stops it) has been told: once, whoever tells it
        self._reported = False
        self._all_done = threading.Event()
        self._exit_status: int | None = None
        #: the status rank 0 must end with once a failure or signal has been decided on (None: no such end)
        self._forced_exit: int | None = None
        self._previous_excepthook: Callable[..., Any] = sys.excepthook
        self._original_exit: Callable[..., Any] = sys.exit
        self._thread: threading.Thread | None = None

    def _in_rank0(self) -> bool:
        return os.getpid() == self._pid

    def start(self) -> None:
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._original_exit = sys.exit
        sys.exit = self._recording_exit  # atexit cannot see the exit status otherwise
        atexit.register(self._at_exit)
        self._install_signal_handling()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)
        self._thread = threading.Thread(target=self._monitor, name="fabric-rank0-supervisor", daemon=True)
        self._thread.start()

    def _install_signal_handling(self) -> None:
        """Make Ctrl-C and SIGTERM end the job even while rank 0 is stuck in C code (see SignalPipe)."""
        if threading.current_thread() is not threading.main_thread():
            return
        watched = set()
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            watched.add(signal.SIGINT)  # the main thread also gets its KeyboardInterrupt, as usual
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._sigterm_handler = only_in_this_process(lambda signum, frame: self._abort_for_signal(signum))
            signal.signal(signal.SIGTERM, self._sigterm_handler)
            watched.add(signal.SIGTERM)
        self.supervisor.signals = SignalPipe(watched)

    def _after_fork_in_child(self) -> None:
        """A fork of rank 0 must not feed our signal pipe nor run our SIGTERM teardown."""
        if self._in_rank0():
            return
        if self.supervisor.signals is not None:
            self.supervisor.signals.release_after_fork()
        try:
            if signal.getsignal(signal.SIGTERM) is getattr(self, "_sigterm_handler", None):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass

    # -- hooks -------------------------------------------------------------------------------

    def _recording_exit(self, status: Any = None, /) -> Any:
        if self._in_rank0():
            self._exit_status = 0 if status is None else (status if isinstance(status, int) else 1)
        return self._original_exit(status)

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not self._in_rank0():
            self._previous_excepthook(exc_type, exc, tb)
            return
        # left in the job folder too: the monitor thread, reporting a child's failure meanwhile, names rank 0 with
        # it when rank 0 met the same
        brief = record_exception(self.supervisor.job_dir, self.rank, exc) or brief_traceback(exc)
        if full_tracebacks():
            print_rank_exception(self.rank, self._previous_excepthook, exc_type, exc, tb)
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C: one line for the job, as when the monitor thread hears it
            self._stop_for_signal(signal.SIGINT)
            return
        trace = "".join(traceback.format_exception(exc_type, exc, tb))
        self._stop_job(f"rank {self.rank} failed", own_trace=trace, own_brief=brief)

    def rank_zero_failed(self, trace: str, exc: BaseException | None = None) -> None:
        """Rank 0's code raised ``exc`` (reported by the strategy): diagnose, stop the children, keep running."""
        if self._in_rank0():
            brief = brief_traceback(exc) if exc is not None else None
            self._stop_job(f"rank {self.rank} failed", own_trace=trace, kill_own=False, own_brief=brief)

    def _stop_job(self, reason: str, own_trace: str | None = None, kill_own: bool = True, own_brief: str | None = None) -> None:
        """Rank 0 is going down on its own terms: take the children (and its own subprocesses) along."""
        raised_at = time.monotonic()
        with self._lock:
            if not self._stopping:
                self._stopping = True
                # Rank 0's error may only echo a child's death ("connection closed by peer"): if a child
                # failed too, that is the news worth reporting.
                cause = self.supervisor.root_cause(own_raised_at=raised_at if own_trace is not None else None, own_trace=own_trace)
                # the ranks still running: the children that run, and rank 0 itself
                running = {handle.rank for handle in self.supervisor.alive()} | {self.rank}
                if cause is not None:
                    failure = self.supervisor.failure_of(cause)
                    # rank 0's own error echoes the child's end: the job ends with the child's status
                    self._forced_exit = JobResult(failure=failure).exit_status
                elif own_trace is not None:
                    failure = RankFailure(self.rank, os.getpid(), None, True, None if own_brief is not None else own_trace)
                if cause is not None or own_trace is not None:
                    self._tell(self.supervisor.failure_report(failure, running, own_brief))
                elif len(running) > 1:
                    self._tell(f"{reason}; stopping the other {len(running) - 1} rank(s) on this node")
                self._report(self.supervisor.diagnose(own_trace=own_trace, own_running=False))
                self.supervisor.stop()
                self.supervisor.close()
            elif own_trace is not None and not self._reported:
                # the children were stopped on purpose (the strategy's kill()) before rank 0's error came here:
                # their ends are no failure, and rank 0's error is the one to tell
                failure = RankFailure(self.rank, os.getpid(), None, True, None if own_brief is not None else own_trace)
                self._tell(self.supervisor.failure_report(failure, (), own_brief))
        if kill_own:
            with self._lock:
                # Also after a deliberate kill(): rank 0's own subprocesses must not outlive it.
                self._kill_own_subprocesses()

    def _at_exit(self) -> None:
        if not self._in_rank0():
            return
        try:
            if self._stopping and self._forced_exit is not None:
                self._end_as_decided()  # a child's failure was the cause: its status is the job's
            if self._exit_status not in (None, 0):
                self._stop_job(f"rank {self.rank} is exiting with status {self._exit_status}")
                return
            if getattr(sys, "last_value", None) is not None:
                # An unhandled exception even though our excepthook was replaced.
                self._stop_job(f"rank {self.rank} failed")
                return
            # Rank 0 is done: the job is done when every rank is. The monitor thread ends the process
            # (non-zero) should a child fail while we wait.
            while not self._all_done.wait(POLL_S):
                if self._stopping:
                    self._end_as_decided()
                    return
                if self._thread is None or not self._thread.is_alive():
                    self._act(self._wait())
        except KeyboardInterrupt:
            self._abort_for_signal(signal.SIGINT, grace=0.0)

    def _end_as_decided(self) -> None:
        """Somebody is stopping the job: wait until its teardown is over, then end with its status.

        The monitor thread sets ``_stopping`` before it tears down (which takes a while); without this
        wait the interpreter would finish its exit meanwhile and report success for a failed job.
        """
        with self._lock:  # held by whoever stops the job until its teardown is done
            code = self._forced_exit
        if code is not None:
            _end_now(code)

    # -- the monitor thread ------------------------------------------------------------------------

    def _monitor(self) -> None:
        self._act(self._wait())

    def _wait(self) -> JobResult:
        """The supervisor's result, passing over signals that rank 0's own code now handles.

        The pipe carries SIGTERM (and SIGINT) because they were ours when the job started; once the
        script installs its own handler (``fabric.preempted`` does, to hear the cluster's warning),
        the signal is the script's to act on and the job goes on.
        """
        while True:
            result = self.supervisor.wait()
            if result.signal is None or self._handles(result.signal):
                return result

    def _handles(self, signum: int) -> bool:
        """Whether ``signum`` still ends the job here (rank 0's handler for it is still ours)."""
        ours = signal.default_int_handler if signum == signal.SIGINT else getattr(self, "_sigterm_handler", None)
        try:
            return signal.getsignal(signum) is ours
        except (ValueError, OSError):
            return True

    def _act(self, result: JobResult) -> None:
        if result.signal is not None:
            self._abort_for_signal(result.signal)
        elif result.failure is not None:
            self._fail(result)
        elif not self._stopping:
            # All children finished cleanly. From here on rank 0 is an ordinary process.
            self.supervisor.close()
            self._all_done.set()

    def _fail(self, result: JobResult) -> None:
        assert result.failure is not None
        with self._lock:
            if self._stopping:
                return  # a deliberate stop (kill(), rank 0's own failure): no second report
            self._stopping = True
            self._forced_exit = result.exit_status
            try:
                # the ranks still running: the children that run, and rank 0
                running = {handle.rank for handle in self.supervisor.alive()} | {self.rank}
                self._tell(self.supervisor.failure_report(result.failure, running))
                self._report(result.diagnosis)
                self._teardown()
            finally:  # whatever the teardown ran into, the job failed, with the failed rank's status
                _end_now(self._forced_exit)

    def _stop_for_signal(self, signum: int) -> None:
        """Ctrl-C / SIGTERM: say so in one line (the first to hear it) and stop the children; rank 0 ends with 128 + signum."""
        with self._lock:
            first = not self._stopping
            self._stopping = True
            if self._forced_exit is None:
                self._forced_exit = 128 + signum
            if not self._reported:
                self._tell(f"rank {self.rank} received {signal_name(signum)}; stopping all ranks")
            if first:
                self._teardown()

    def _abort_for_signal(self, signum: int, grace: float | None = None) -> None:
        """Ctrl-C / SIGTERM heard outside the main thread's unwinding: stop the job, then end rank 0 with 128 + signum."""
        self._stop_for_signal(signum)
        if grace is None:
            grace = _SIGINT_GRACE_S if signum == signal.SIGINT else 0.0
        if grace > 0 and threading.current_thread() is not threading.main_thread():
            # Give the main thread the chance to unwind (finally blocks, KeyboardInterrupt).
            threading.Event().wait(grace)
        _end_now(128 + signum)

    # -- teardown -----------------------------------------------------------------------------------

    def stop_children(self, signum: int = signal.SIGTERM) -> None:
        """Stop every child rank's process group; later deaths are no longer failures."""
        if not self._in_rank0():
            return
        with self._lock:
            self._stopping = True
            self.supervisor.stop(signum)
            self.supervisor.close()

    def _tell(self, report: str) -> None:
        """The job's one report (the caller holds the lock)."""
        self._reported = True
        write_stderr(f"[fabric] {report}")

    @staticmethod
    def _report(diagnosis: str | None) -> None:
        if diagnosis:
            write_stderr(diagnosis)

    def _teardown(self) -> None:
        """Rank 0 is about to end: stop the children and rank 0's own subprocesses."""
        self.supervisor.stop()
        self.supervisor.close()
        self._kill_own_subprocesses()

    def _kill_own_subprocesses(self) -> None:
        """Rank 0 is going down: take its own subprocesses (not the multiprocessing helpers) with it."""
        if threading.current_thread() is threading.main_thread():
            # Stop e.g. DataLoader's SIGCHLD handler from raising while we kill its workers.
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            except (ValueError, OSError, AttributeError):
                pass
        keep = _multiprocessing_helper_pids() | {h.pid for h in self.supervisor.ranks if h.pid is not None}
        pids = descendant_pids(os.getpid(), exclude=keep)
        if pids:
            kill_processes(pids, signal.SIGTERM, GRACE_S)


def _end_now(code: int) -> NoReturn:
    """End rank 0 with ``code`` at once, skipping ``atexit``, but not what must reach disk first.

    The callbacks of :mod:`fabric._core.process_end` (the loggers' last rows and events) run first,
    for at most ``HARD_END_WAIT_S``.
    """
    run_process_end_callbacks(timeout=HARD_END_WAIT_S)
    flush_stdio()
    os._exit(code)


def _multiprocessing_helper_pids() -> set[int]:
    """Pids of the stdlib's resource tracker and fork server, which rank 0 still needs."""
    pids: set[int] = set()
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    if isinstance(pid, int):
        pids.add(pid)
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if isinstance(pid, int):
        pids.add(pid)
    return pids
