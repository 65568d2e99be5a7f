"""Shared machinery that keeps a multi-process job from hanging or leaking processes.

The launchers promise that when one rank of a job fails, the others are gone within
seconds, that the failure is reported once with the rank that caused it, and that no
process of the job (subprocesses of ranks included) keeps running afterwards. The
pieces that both launchers need for this live here:

* killing whole process groups (every rank is started as the leader of its own
  group, so its subprocesses can be found and stopped along with it),
* rank-labelled traceback formatting and exit-status descriptions,
* a watchdog thread that makes a child rank stop itself when its launcher dies, even
  if the launcher was killed with ``SIGKILL`` and could not clean up.

Only the standard library is used, so importing this module is cheap.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType

__all__ = [
    "KILL_GRACE_S",
    "PARENT_PID_ENV",
    "POLL_INTERVAL_S",
    "RankFailedError",
    "STATUS_FD_ENV",
    "become_group_leader",
    "describe_exit",
    "descendant_pids",
    "flush_stdio",
    "format_rank_traceback",
    "kill_own_group_and_exit",
    "kill_process_groups",
    "kill_processes",
    "label_lines",
    "process_alive",
    "signal_name",
    "start_parent_watchdog",
    "write_stderr",
]

#: Set in the environment of ranks started by :class:`SubprocessScriptLauncher`: the pid
#: of the launching process. A rank that sees its parent's pid here is one of ours and
#: starts the parent-death watchdog.
PARENT_PID_ENV = "FABRIC_PARENT_PID"
#: File descriptor (inherited) on which a child rank tells its launcher "I raised".
STATUS_FD_ENV = "FABRIC_STATUS_FD"

#: Seconds a process gets between SIGTERM and SIGKILL during teardown.
KILL_GRACE_S = 1.5
#: How often supervisors and watchdogs look at the processes they watch.
POLL_INTERVAL_S = 0.1

_IS_LINUX = sys.platform.startswith("linux")


class RankFailedError(RuntimeError):
    """A rank of the job failed; carries which one, how, and its traceback text."""

    def __init__(
        self, rank: int, exitcode: int | None, traceback_text: str | None = None, diagnosis: str | None = None
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.traceback_text = traceback_text
        #: for a collective timeout: which ranks did not arrive and where every rank was
        self.diagnosis = diagnosis
        message = describe_exit(rank, exitcode, raised=traceback_text is not None)
        if traceback_text:
            message = f"{message}:\n{traceback_text.rstrip()}"
        if diagnosis:
            message = f"{message}\n{diagnosis}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[int, int | None, str | None, str | None]]:
        return (type(self), (self.rank, self.exitcode, self.traceback_text, self.diagnosis))


def signal_name(signum: int) -> str:
    """``9`` -> ``"SIGKILL"``; unknown numbers are returned as ``"signal N"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(rank: int, exitcode: int | None, *, raised: bool = False) -> str:
    """One human sentence about how a rank ended, e.g. ``rank 1 was killed by SIGKILL``.

    ``exitcode`` follows the ``subprocess``/``multiprocessing`` convention: negative
    numbers are the signal that killed the process.
    """
    if raised:
        detail = f" (exit code {exitcode})" if exitcode is not None and exitcode > 0 else ""
        return f"rank {rank} raised an exception{detail}"
    if exitcode is None:
        return f"rank {rank} failed"
    if exitcode < 0:
        return f"rank {rank} was killed by {signal_name(-exitcode)}"
    return f"rank {rank} exited with code {exitcode}"


def label_lines(text: str, rank: int) -> str:
    """Prefix every line with ``[rank N]`` so interleaved output stays attributable."""
    prefix = f"[rank {rank}] "
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def format_rank_traceback(
    rank: int,
    exc_type: type[BaseException],
    exc: BaseException,
    tb: TracebackType | None,
) -> str:
    """The usual traceback text, every line labelled with the rank."""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if not text.endswith("\n"):
        text += "\n"
    return label_lines(text, rank)


def write_stderr(message: str) -> None:
    """Write and flush, ignoring a closed or broken stderr (we may be dying)."""
    try:
        sys.stderr.write(message if message.endswith("\n") else message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def flush_stdio() -> None:
    """Flush Python's stdout/stderr buffers before an ``os._exit``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


# --------------------------------------------------------------------------------------
# Looking at processes
# --------------------------------------------------------------------------------------


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process from ``/proc``, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 3:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _all_stats() -> dict[int, tuple[str, int, int]]:
    stats: dict[int, tuple[str, int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return stats
    for entry in entries:
        if entry.isdigit():
            stat = _read_stat(int(entry))
            if stat is not None:
                stats[int(entry)] = stat
    return stats


def process_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited process nobody reaped)."""
    if _IS_LINUX:
        stat = _read_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is still in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not _IS_LINUX:
        return True
    # Zombies still count as group members for kill(); only live ones matter to us.
    return any(state not in ("Z", "X") and pg == pgid for state, _, pg in _all_stats().values())


def descendant_pids(root: int, exclude: Iterable[int] = ()) -> list[int]:
    """All live descendants of ``root`` (Linux only; elsewhere an empty list).

    Subtrees rooted at a pid in ``exclude`` are skipped entirely.
    """
    if not _IS_LINUX:
        return []
    skip = set(exclude)
    children: dict[int, list[int]] = {}
    for pid, (state, ppid, _) in _all_stats().items():
        if state not in ("Z", "X"):
            children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in skip:
                found.append(child)
                stack.append(child)
    return found


# --------------------------------------------------------------------------------------
# Killing processes
# --------------------------------------------------------------------------------------


def _send(pid: int, signum: int, as_group: bool) -> None:
    try:
        if as_group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate_then_kill(
    targets: list[tuple[int, bool]],
    signum: int,
    grace: float,
    reap: Callable[[], None] | None,
) -> None:
    """Send ``signum`` to each target, wait up to ``grace`` s, then SIGKILL the rest."""
    if not targets:
        return
    for pid, as_group in targets:
        _send(pid, signum, as_group)
    if signum != signal.SIGKILL:
        deadline = time.monotonic() + grace
        while True:
            if reap is not None:
                reap()
            remaining = [(p, g) for p, g in targets if (_group_alive(p) if g else process_alive(p))]
            if not remaining or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        targets = remaining
    for pid, as_group in targets:
        _send(pid, signal.SIGKILL, as_group)
    if reap is not None:
        reap()


def kill_process_groups(
    pids: Iterable[int],
    signum: int = signal.SIGTERM,
    grace: float = KILL_GRACE_S,
    reap: Callable[[], None] | None = None,
) -> None:
    """Stop each process in ``pids`` together with everything in its process group.

    Every rank is meant to lead its own group; a process that has not got that far yet
    (it was just started) is signalled on its own instead. After ``signum`` the targets
    get ``grace`` seconds to exit before they are sent ``SIGKILL``. ``reap`` is called
    while waiting so that exited children of ours do not linger as zombies.
    """
    targets: list[tuple[int, bool]] = []
    for pid in pids:
        try:
            is_leader = os.getpgid(pid) == pid
        except (ProcessLookupError, PermissionError):
            # Already reaped: its group may still hold orphaned subprocesses.
            is_leader = True
        targets.append((pid, is_leader))
    _terminate_then_kill(targets, signum, grace, reap)


def kill_processes(
    pids: Iterable[int],
    signum: int = signal.SIGTERM,
    grace: float = KILL_GRACE_S,
    reap: Callable[[], None] | None = None,
) -> None:
    """Like :func:`kill_process_groups` but for individual processes."""
    _terminate_then_kill([(pid, False) for pid in pids], signum, grace, reap)


def kill_own_group_and_exit(exit_code: int = 1, grace: float = KILL_GRACE_S) -> None:
    """End this process and every process in its group (its subprocesses).

    Used by a rank that must stop on its own, e.g. because its launcher died. If this
    process does not lead its group (it was not started by our launcher), only its
    descendants are killed, so that we never hit processes outside the job.
    """
    flush_stdio()
    pgid = os.getpgrp()
    if pgid == os.getpid():
        # SIGTERM usually ends us right here; the SIGKILL is for handlers that ignore it.
        _send(pgid, signal.SIGTERM, True)
        time.sleep(grace)
        _send(pgid, signal.SIGKILL, True)
    else:
        kill_processes(descendant_pids(os.getpid()), grace=grace)
    os._exit(exit_code)


# --------------------------------------------------------------------------------------
# Child side: noticing that the launcher is gone
# --------------------------------------------------------------------------------------


def _launcher_gone(expected_ppid: int, launcher_pid: int) -> bool:
    if os.getppid() != expected_ppid:
        return True  # our parent exited and we were re-parented
    return launcher_pid != expected_ppid and not process_alive(launcher_pid)


def start_parent_watchdog(
    rank: int,
    launcher_pid: int,
    expected_ppid: int | None = None,
    interval: float = POLL_INTERVAL_S * 2,
) -> threading.Thread:
    """Start a daemon thread that stops this rank (and its group) if the launcher dies.

    Polling ``getppid`` catches every way the launcher can end, ``SIGKILL`` included,
    and unlike ``PR_SET_PDEATHSIG`` it lets us take our own subprocesses down too
    instead of dying alone. ``launcher_pid`` is also checked directly for ranks whose
    parent is a helper (the multiprocessing fork server) rather than the launcher.
    """
    ppid = os.getppid() if expected_ppid is None else expected_ppid

    def watch() -> None:
        while not _launcher_gone(ppid, launcher_pid):
            time.sleep(interval)
        write_stderr(
            f"[rank {rank}] the launching process (pid {launcher_pid}) is gone; "
            "stopping this rank and its subprocesses"
        )
        kill_own_group_and_exit(1)

    thread = threading.Thread(target=watch, name=f"fabric-parent-watchdog-rank{rank}", daemon=True)
    thread.start()
    return thread


def become_group_leader() -> None:
    """Start a new session so the launcher can kill this rank with all its subprocesses."""
    if hasattr(os, "setsid"):
        try:
            os.setsid()
        except OSError:
            pass  # already a group leader
