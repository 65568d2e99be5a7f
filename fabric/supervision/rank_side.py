"""What runs inside a rank so that it never outlives its supervisor and its failures are reported once.

The parent-death policy, the same for every rank a fabric supervisor starts:

* A rank started from a command line (``fabric run``, the popen launcher) begins life in a tiny
  trampoline that asks Linux for ``PR_SET_PDEATHSIG`` (SIGKILL) and then becomes the real command.
  From its first instruction on, the rank cannot outlive its supervisor, even one killed by SIGKILL.
* As soon as fabric code runs in the rank (a launcher's child side, a multiprocessing worker),
  :func:`follow_supervisor` takes over with a watchdog thread: when the supervisor is gone, the rank
  stops itself *and its process group* (DataLoader workers, shell commands), which the kernel's
  signal alone would leave behind.
* When the rank's interpreter begins to end, the kernel takes over again (``PR_SET_PDEATHSIG``, SIGKILL): once
  the interpreter finalizes, no daemon thread runs again, the watchdog included, while what is collected then
  (a file on a store left open uploads itself as it closes) may hang with nobody watching.

A rank tells its supervisor that it raised through an inherited pipe (:func:`report_raise`), before
its interpreter shutdown, which may take long or hang. It prints nothing of its own: it leaves its traceback
in the job folder (:func:`record_exception`) and the supervisor reports the failure once, for every rank
that met it (``failure_report``), unless ``FABRIC_FULL_TRACEBACKS=1`` asks each rank for its whole traceback.

Only the standard library is used, so importing this module is cheap.
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
from typing import Any

from fabric._core.processes import flush_stdio, kill_own_group_and_exit, process_alive, run_for_at_most
from fabric.supervision.diagnosis import record_failure
from fabric.supervision.failure_report import brief_traceback, record_brief
from fabric.supervision.supervisor import GRACE_S, POLL_S

__all__ = [
    "exit_status_of",
    "follow_supervisor",
    "format_rank_traceback",
    "label_lines",
    "print_rank_exception",
    "rank_command",
    "record_exception",
    "report_exit",
    "report_raise",
    "write_stderr",
]

_PR_SET_PDEATHSIG = 1
#: how long a rank that is ending waits to tell why on stderr (a stream blocked by another thread must not hold it)
_SAY_WAIT_S = 1.0

# Started in place of the rank's command: bind to the supervisor's death, then become the command. A
# fresh interpreter rather than preexec_fn, which is unsafe once the starting process has threads.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    f"    libc.prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0)\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        os._exit(137)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def rank_command(command: list[str]) -> list[str]:
    """The command line that starts ``command`` as a rank bound to this process's death (Linux)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *command]


def _set_parent_death_signal(signum: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def follow_supervisor(rank: int, supervisor_pid: int, expected_ppid: int | None = None) -> threading.Thread:
    """Stop this rank and its process group as soon as the supervisor is gone (a daemon thread).

    Polling ``getppid`` catches every way the supervisor can end, ``SIGKILL`` included.
    ``supervisor_pid`` is also checked directly for ranks whose parent is a helper (the multiprocessing
    fork server) rather than the supervisor. The kernel's parent-death signal is cleared: from here on
    the watchdog decides, and it takes the rank's subprocesses along, until the interpreter begins to end,
    where the kernel's SIGKILL on the parent's death is set again (the watchdog does not outlive the
    interpreter's finalization).
    """
    ppid = os.getppid() if expected_ppid is None else expected_ppid
    me = os.getpid()
    _set_parent_death_signal(0)

    def gone() -> bool:
        if os.getppid() != ppid:
            return True  # our parent exited and we were re-parented
        return supervisor_pid != ppid and not process_alive(supervisor_pid)

    stopping = threading.Lock()

    def stop() -> None:
        if not stopping.acquire(blocking=False):  # the watchdog or the exit hook is ending this rank already
            while True:
                time.sleep(60)
        write_stderr(
            f"[rank {rank}] the launching process (pid {supervisor_pid}) is gone; stopping this rank and its subprocesses",
            timeout=_SAY_WAIT_S,
        )
        kill_own_group_and_exit(1, GRACE_S)

    def watch() -> None:
        while not gone():
            time.sleep(POLL_S)
        stop()

    def at_shutdown() -> None:
        # The interpreter is ending (registered now, this runs after every exit hook registered later). Once it
        # finalizes, the watchdog (a daemon thread) never runs again, and an object collected then may hang (a file on
        # a store left open uploads itself as it closes): the kernel's SIGKILL takes over the supervisor's death.
        if os.getpid() != me:  # a forked copy of this rank
            return
        _set_parent_death_signal(signal.SIGKILL)
        if gone():  # gone before the kernel was asked: nobody would tell us any more
            stop()

    atexit.register(at_shutdown)
    thread = threading.Thread(target=watch, name=f"fabric-supervisor-watchdog-rank{rank}", daemon=True)
    thread.start()
    return thread


def report_raise(status_fd: int | None) -> None:
    """Tell the supervisor, through the status pipe, that this rank raised and when."""
    _report(status_fd, f"E{time.monotonic():.6f}")


def report_exit(status_fd: int | None, status: int | None) -> None:
    """Tell the supervisor that this rank begins to exit with ``status`` (None: not known), and when.

    Sent before the interpreter's shutdown leaves the process group: the peers' "connection closed"
    errors that follow must not be taken for the cause.
    """
    _report(status_fd, f"X{'?' if status is None else status} {time.monotonic():.6f}")


def _report(status_fd: int | None, line: str) -> None:
    """One line on the status pipe (nothing without one; a supervisor already gone is no error)."""
    if status_fd is None:
        return
    try:
        os.write(status_fd, f"{line}\n".encode())
    except OSError:
        pass


def exit_status_of(code: object) -> int:
    """The process status ``sys.exit(code)`` ends with: None 0, an int its low byte, anything else 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


# --------------------------------------------------------------------------------------
# Rank-labelled output
# --------------------------------------------------------------------------------------


def write_stderr(message: str, timeout: float | None = None) -> None:
    """Write to the process's real stderr in one system call, ignoring a closed or broken one (we may be dying).

    Not through ``sys.stderr``: torch.distributed's excepthook points it at a buffer while the hook it wrapped
    runs, and a report another thread wrote there then was lost when the process ended (``os._exit``).
    ``timeout``: wait at most this long (the write goes on in a daemon thread): a process about to end must not
    stay because another thread blocked stderr (a full pipe nobody reads).
    """
    if timeout is not None:
        run_for_at_most(lambda: write_stderr(message), timeout, "fabric-say")
        return
    try:
        if sys.__stderr__ is not None:
            sys.__stderr__.flush()  # what was written before goes first
    except (OSError, ValueError):
        pass
    try:
        os.write(2, (message if message.endswith("\n") else message + "\n").encode(errors="replace"))
    except OSError:
        pass


def label_lines(text: str, rank: int) -> str:
    """Prefix every line with ``[rank N]`` so interleaved output stays attributable."""
    prefix = f"[rank {rank}] "
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def format_rank_traceback(rank: int, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> str:
    """The usual traceback text, every line labelled with the rank."""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if not text.endswith("\n"):
        text += "\n"
    return label_lines(text, rank)


def print_rank_exception(
    rank: int,
    previous_hook: Callable[..., Any],
    exc_type: type[BaseException],
    exc: BaseException,
    tb: TracebackType | None,
) -> None:
    """Print an unhandled exception once, every line labelled ``[rank N]``, keeping a richer hook if there is one.

    Written to the real stderr: torch.distributed's excepthook (installed by ``init_process_group``) captures what
    the hook it wrapped writes to ``sys.stderr`` and labels it ``[rankN]:``, a second form of the same label.
    """
    if previous_hook is sys.__excepthook__ or getattr(previous_hook, "__name__", "") == "_distributed_excepthook":
        write_stderr(format_rank_traceback(rank, exc_type, exc, tb))
    else:
        # Somebody installed a richer hook (IPython, rich, ...): keep it, add the label.
        write_stderr(f"[rank {rank}] unhandled exception:")
        previous_hook(exc_type, exc, tb)
        flush_stdio()


def record_exception(job_dir: str | None, rank: int, exc: BaseException) -> str | None:
    """Leave this rank's whole traceback and its brief one in the job folder, for the supervisor's one report.

    Returns the brief traceback, or None where it could not be left (no job folder): the rank must then print
    its traceback itself.
    """
    record_failure(job_dir, rank, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    brief = brief_traceback(exc)
    return brief if record_brief(job_dir, rank, brief) else None
