"""The signals that reach a supervisor: how it hears them, and which it passes on to the ranks.

:class:`SignalPipe` makes a signal to the supervising process readable as a descriptor, so a
supervisor waiting in ``poll`` (on any thread) acts on it at once. :class:`SignalTap` tells a callback on a
thread of its own of each delivery at once, so a rank whose main thread is blocked (in an upload, in a
collective) still acts on a signal (the pre-emption listener's second SIGTERM).

:class:`SignalForwarding` is what ``fabric run`` does with the cluster's pre-emption warnings. SLURM
(``--signal=USR1@90``, or SIGTERM on pre-emption) and Kubernetes (SIGTERM, then SIGKILL after the
pod's grace period) signal the launching process, not the ranks. A launcher that ends the job on such
a warning leaves the loop no time to save, so the warning is handed on and the ranks decide when to
stop (``fabric.preempted``):

* **SIGUSR1** goes to every running rank's own pid (never its process group: DataLoader workers and
  other subprocesses of the rank must not get it) and the job goes on as before.
* **SIGTERM** goes to every running rank the same way; the ranks then get ``shutdown_timeout``
  seconds (30 by default, as torchrun) to end on their own. Ranks still running after that are
  stopped as a job is always stopped (SIGTERM to their process groups, a short grace, SIGKILL).
* A **second SIGTERM**, SIGINT (Ctrl-C) or SIGHUP stops the job at once, as without forwarding.

A job that ends after a forwarded warning ends with the ranks' status (0 when every rank saved and
exited 0), and is never restarted: the machine is going away. The popen launcher needs no
forwarding: its rank 0 is the user's process and hears the signal itself.

Only the standard library is used (``fabric run`` imports this module before any rank starts).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from fabric._core.processes import signal_name

__all__ = ["FORWARDED_SIGNALS", "SHUTDOWN_TIMEOUT_S", "SignalForwarding", "SignalPipe", "SignalTap", "supervising_signals"]

#: the warnings passed on to the ranks instead of stopping the job
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: seconds the ranks get to end on their own after a forwarded SIGTERM (torchrun's default too)
SHUTDOWN_TIMEOUT_S = 30.0


class SignalPipe:
    """Signals delivered to this process, readable as a descriptor by any thread.

    Python runs signal handlers only in the main thread, between bytecodes; a main thread blocked in a
    collective would never see them. Through ``signal.set_wakeup_fd`` the C-level handler writes each
    signal number to a pipe at once, so a supervisor waiting in ``poll`` wakes up and acts. Only
    installed from the main thread and only when nobody else (an event loop) owns the wakeup fd.
    """

    def __init__(self, watched: Iterable[int]) -> None:
        self.watched = set(watched)
        self.fd: int | None = None
        self._pending: list[int] = []  # read from the pipe, not taken yet
        self._write_fd: int | None = None
        pipe = _wakeup_pipe()
        if pipe is None:
            return
        read_fd, write_fd, previous = pipe
        if previous != -1:
            signal.set_wakeup_fd(previous)  # somebody else's: leave it to them
            os.close(read_fd)
            os.close(write_fd)
            return
        self.fd, self._write_fd = read_fd, write_fd

    def take(self) -> int | None:
        """The oldest watched signal not taken yet, or None (each delivery is taken once, in order)."""
        if self.fd is None:
            return None
        try:
            self._pending.extend(signum for signum in os.read(self.fd, 512) if signum in self.watched)
        except OSError:  # nothing there (non-blocking read)
            pass
        return self._pending.pop(0) if self._pending else None

    def release_after_fork(self) -> None:
        """In a forked copy of this process: stop feeding the pipe, which belongs to the parent."""
        if self._write_fd is not None:
            _stop_feeding(self._write_fd)

    def close(self) -> None:
        if self.fd is None or self._write_fd is None:
            return
        self.release_after_fork()  # the same step: this process stops feeding the pipe
        os.close(self.fd)
        os.close(self._write_fd)
        self.fd = self._write_fd = None


class SignalTap:
    """Each delivery of the ``watched`` signals told at once to ``on_signal(signum)``, on a daemon thread of its own.

    The same wakeup descriptor as :class:`SignalPipe` (the C-level handler writes each delivered signal's number to it
    at once, whatever the main thread is doing), read by the tap's thread, which calls ``on_signal`` in the order of
    delivery. Python's own handler of the signal must stay installed (the caller's): without one the signal keeps its
    default action. A wakeup descriptor set before (a supervisor's ``SignalPipe``, an event loop's) keeps getting
    every byte: the tap passes them on. Only the main thread can set the tap up; elsewhere, or where the descriptor
    cannot be set, ``installed`` is False and the caller's handler is all there is. A forked child stops feeding the
    tap (it has no thread reading it): :func:`_release_taps_in_child`.
    """

    def __init__(self, watched: Iterable[int], on_signal: Callable[[int], object]) -> None:
        self.watched = frozenset(watched)
        self._on_signal = on_signal
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._next_fd: int | None = None  # a copy of the descriptor set before ours: every byte goes on to it
        self._owner = os.getpid()
        pipe = _wakeup_pipe()
        if pipe is None:
            return
        read_fd, write_fd, previous = pipe
        if previous != -1:
            try:
                self._next_fd = os.dup(previous)  # its pipe stays open for us even after its owner closes it
            except OSError:
                self._next_fd = None
        self._read_fd, self._write_fd = read_fd, write_fd
        _TAPS.add(self)
        threading.Thread(target=self._run, name="fabric-signal-tap", daemon=True).start()

    @property
    def installed(self) -> bool:
        """Whether the tap hears the signals in this process (its thread reads them)."""
        return self._read_fd is not None and os.getpid() == self._owner

    def _run(self) -> None:
        read_fd = self._read_fd
        if read_fd is None:
            return
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        while True:
            poller.poll()  # the GIL is released while it waits
            try:
                data = os.read(read_fd, 512)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not data:
                return
            self._pass_on(data)
            for signum in data:
                if signum in self.watched:
                    self._on_signal(signum)

    def _pass_on(self, data: bytes) -> None:
        if self._next_fd is None:
            return
        try:
            os.write(self._next_fd, data)
        except BlockingIOError:
            pass  # its pipe is full: its owner drops the signal, as it would have without us
        except OSError:  # nobody reads it any more
            os.close(self._next_fd)
            self._next_fd = None

    def release_in_child(self) -> None:
        """In a forked copy of the process: stop feeding the tap (no thread reads it here) and drop its descriptors."""
        if self._write_fd is None:
            return
        _stop_feeding(self._write_fd)
        for fd in (self._read_fd, self._write_fd, self._next_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._read_fd = self._write_fd = self._next_fd = None


def _wakeup_pipe() -> tuple[int, int, int] | None:
    """A new non-blocking pipe whose write end is now this process's wakeup descriptor: (read end, write end, the
    descriptor set before it, -1 for none). None off the main thread, or where the descriptor cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    try:
        return read_fd, write_fd, signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_fd)
        os.close(write_fd)
        return None


def _stop_feeding(write_fd: int) -> None:
    """This process stops writing the signals it gets to ``write_fd``; a wakeup descriptor set since is left alone."""
    try:
        previous = signal.set_wakeup_fd(-1)
        if previous != write_fd:
            signal.set_wakeup_fd(previous)  # not ours any more: leave it alone
    except (ValueError, OSError):
        pass


_TAPS: weakref.WeakSet[SignalTap] = weakref.WeakSet()


def _release_taps_in_child() -> None:
    for tap in list(_TAPS):
        tap.release_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_release_taps_in_child)


class SignalForwarding:
    """The forwarding policy of one supervisor: which signal is passed on, and when the job must stop.

    Args:
        shutdown_timeout: seconds the ranks get to end after a forwarded SIGTERM (None: :data:`SHUTDOWN_TIMEOUT_S`).
        report: told (e.g. a print to stderr) what was passed on and why the job is stopped.
    """

    def __init__(self, shutdown_timeout: float | None = None, report: Callable[[str], object] | None = None) -> None:
        shutdown_timeout = SHUTDOWN_TIMEOUT_S if shutdown_timeout is None else shutdown_timeout
        if not 0 <= shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout={shutdown_timeout!r} is not valid; accepted: a number of seconds >= 0")
        self.shutdown_timeout = shutdown_timeout
        self.report = report
        #: the strongest warning passed on in this attempt (SIGTERM over SIGUSR1), or None
        self.forwarded: int | None = None
        self._deadline: float | None = None
        self._overdue = False

    def reset(self) -> None:
        """A fresh attempt of the job: nothing has been passed on to its ranks."""
        self.forwarded, self._deadline, self._overdue = None, None, False

    def stops_job(self, signum: int, running_pids: Iterable[int]) -> bool:
        """Act on ``signum`` that reached the supervisor; True when the job must be stopped now."""
        if signum not in FORWARDED_SIGNALS or (signum == signal.SIGTERM and self._deadline is not None):
            return True  # Ctrl-C, SIGHUP, or SIGTERM again: the user (or scheduler) insists
        pids = list(running_pids)
        for pid in pids:
            try:
                os.kill(pid, signum)  # the rank itself, not its group
            except (ProcessLookupError, PermissionError):
                pass
        if signum == signal.SIGTERM:
            self.forwarded = signum
            self._deadline = time.monotonic() + self.shutdown_timeout
            then = f"waiting up to {self.shutdown_timeout:g} s for them to end (a second SIGTERM or Ctrl-C stops them now)"
        else:
            self.forwarded = self.forwarded or signum
            then = "the job goes on until they end"
        self._say(f"received {signal_name(signum)}; passed it on to {len(pids)} rank(s); {then}")
        return False

    def overdue(self) -> bool:
        """Whether the ranks outlived the shutdown timeout of a forwarded SIGTERM (then stop them)."""
        if self._deadline is not None and not self._overdue and time.monotonic() >= self._deadline:
            self._overdue = True
        return self._overdue

    def stop_reason(self, signum: int) -> str:
        """Why the job is being stopped for ``signum``, in the supervisor's report."""
        if self._overdue:
            return f"the ranks did not end within {self.shutdown_timeout:g} s of SIGTERM"
        if signum == signal.SIGTERM and self._deadline is not None:
            return "received SIGTERM again"
        return f"received {signal_name(signum)}"

    def _say(self, message: str) -> None:
        if self.report is not None:
            self.report(message)


def _ignore(signum: int, frame: Any) -> None:
    """A signal the supervisor acts on: the signal pipe has woken it; nothing else to do here."""


@contextmanager
def supervising_signals() -> Iterator[SignalPipe]:
    """While a command supervises ranks: SIGINT, SIGHUP, SIGTERM and SIGUSR1 reach the pipe, not their default action.

    Without this, SIGTERM or SIGUSR1 would end the supervising process and leave its ranks unattended.
    Python lets only the main thread set handlers; from another thread the signals keep their effect.
    """
    watched = [s for s in (signal.SIGINT, getattr(signal, "SIGHUP", None), *FORWARDED_SIGNALS) if s is not None]
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, _ignore) for signum in watched} if main_thread else {}
    pipe = SignalPipe(watched)
    try:
        yield pipe
    finally:
        pipe.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
