"""Processes as the operating system sees them: alive or not, their descendants, stopping whole groups.

Every rank is started as the leader of its own process group, so the rank and everything it started
(DataLoader workers, a shell command) can be stopped together. Linux answers the questions here from
``/proc``, where a zombie (an exited process nobody reaped) can be told from a live one; elsewhere
``kill(pid, 0)`` is the best answer there is.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import NoReturn

from fabric._core.process_end import HARD_END_WAIT_S, run_process_end_callbacks

__all__ = [
    "FLUSH_WAIT_S",
    "become_group_leader",
    "descendant_pids",
    "end_process",
    "flush_stdio",
    "kill_own_group_and_exit",
    "kill_process_groups",
    "kill_processes",
    "process_alive",
    "signal_name",
]

_IS_LINUX = sys.platform.startswith("linux")
_DEAD_STATES = ("Z", "X")


def signal_name(signum: int) -> str:
    """``9`` -> ``"SIGKILL"``; unknown numbers are returned as ``"signal N"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def flush_stdio(timeout: float | None = None) -> None:
    """Flush Python's stdout/stderr buffers before an ``os._exit``.

    ``timeout``: wait at most this long (the flush then goes on in a daemon thread, which the coming ``os._exit``
    ends): a stream whose lock another thread holds while it is blocked in a write (a pipe nobody reads) must not
    keep a process that has to end alive.
    """
    if timeout is None:
        _flush_stdio()
        return
    run_for_at_most(_flush_stdio, timeout, "fabric-flush")


def run_for_at_most(function: Callable[[], object], timeout: float, name: str) -> None:
    """Run ``function`` in a daemon thread and wait for it at most ``timeout`` seconds (it goes on after that, until
    the process ends). Nothing runs when no thread can start this late in the interpreter's end."""
    done = threading.Event()

    def run() -> None:
        function()
        done.set()

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except RuntimeError:  # no new thread this late in the interpreter's end
        return
    done.wait(timeout)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


#: How long a process that must end waits for its stdout/stderr buffers to be flushed.
FLUSH_WAIT_S = 1.0


def end_process(exit_code: int, wait: float) -> NoReturn:
    """End this process now with ``exit_code``, whatever its other threads do (one blocked in I/O included).

    What must reach disk first (``fabric._core.process_end``: the loggers' last rows and events) gets at most
    ``wait`` seconds, the stdio buffers at most :data:`FLUSH_WAIT_S` more; then ``os._exit``, from any thread.
    """
    run_process_end_callbacks(timeout=wait)
    flush_stdio(timeout=FLUSH_WAIT_S)
    os._exit(exit_code)


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
    """Whether ``pid`` exists and is not a zombie. The one answer to "is this pid alive" in fabric."""
    if _IS_LINUX:
        stat = _read_stat(pid)
        return stat is not None and stat[0] not in _DEAD_STATES
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it just is not ours
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
    return any(state not in _DEAD_STATES and pg == pgid for state, _, pg in _all_stats().values())


def descendant_pids(root: int, exclude: Iterable[int] = ()) -> list[int]:
    """All live descendants of ``root`` (Linux only; elsewhere an empty list).

    Subtrees rooted at a pid in ``exclude`` are skipped entirely.
    """
    if not _IS_LINUX:
        return []
    skip = set(exclude)
    children: dict[int, list[int]] = {}
    for pid, (state, ppid, _) in _all_stats().items():
        if state not in _DEAD_STATES:
            children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in skip:
                found.append(child)
                stack.append(child)
    return found


def _send(pid: int, signum: int, as_group: bool) -> None:
    try:
        if as_group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate_then_kill(
    targets: list[tuple[int, bool]], signum: int, grace: float, reap: Callable[[], object] | None
) -> None:
    """Send ``signum`` to each target, wait up to ``grace`` s, then SIGKILL the rest and wait for them to go."""
    if not targets:
        return
    for pid, as_group in targets:
        _send(pid, signum, as_group)
    if signum != signal.SIGKILL:
        targets = _wait_until_gone(targets, grace, reap, 0.02)
    for pid, as_group in targets:
        _send(pid, signal.SIGKILL, as_group)
    # SIGKILL is delivered asynchronously (a process inside a disk write dies when it returns): wait, bounded,
    # so that a caller who stopped its job finds nothing of it alive (and children of ours reaped)
    _wait_until_gone(targets, _KILLED_WAIT_S, reap, 0.01)


def _wait_until_gone(
    targets: list[tuple[int, bool]], timeout: float, reap: Callable[[], object] | None, interval: float
) -> list[tuple[int, bool]]:
    """Reap and look again until no target is alive or ``timeout`` s passed; the targets still alive."""
    deadline = time.monotonic() + timeout
    while True:
        if reap is not None:
            reap()
        targets = [(p, g) for p, g in targets if (_group_alive(p) if g else process_alive(p))]
        if not targets or time.monotonic() >= deadline:
            return targets
        time.sleep(interval)


#: How long stopping processes waits for SIGKILLed ones to be gone.
_KILLED_WAIT_S = 5.0


def kill_process_groups(
    pids: Iterable[int], signum: int, grace: float, reap: Callable[[], object] | None = None
) -> None:
    """Stop each process in ``pids`` together with everything in its process group.

    Every rank is meant to lead its own group; a process that has not got that far yet (it was just
    started) is signalled on its own instead. After ``signum`` the targets get ``grace`` seconds to
    exit before they are sent ``SIGKILL``. ``reap`` is called while waiting so that exited children of
    ours do not linger as zombies.
    """
    targets: list[tuple[int, bool]] = []
    for pid in pids:
        try:
            is_leader = os.getpgid(pid) == pid
        except (ProcessLookupError, PermissionError):
            is_leader = True  # already reaped: its group may still hold orphaned subprocesses
        targets.append((pid, is_leader))
    _terminate_then_kill(targets, signum, grace, reap)


def kill_processes(pids: Iterable[int], signum: int, grace: float) -> None:
    """Like :func:`kill_process_groups` but for individual processes."""
    _terminate_then_kill([(pid, False) for pid in pids], signum, grace, None)


def kill_own_group_and_exit(exit_code: int, grace: float) -> None:
    """End this process and every process in its group (its subprocesses).

    Used by a rank that must stop on its own, e.g. because its supervisor died. If this process does
    not lead its group (it was not started by a fabric supervisor), only its descendants are killed, so
    that we never hit processes outside the job. What must reach disk first (``fabric._core.process_end``:
    the loggers' last rows and events) is written before anything is stopped.
    """
    run_process_end_callbacks(timeout=HARD_END_WAIT_S)
    flush_stdio(timeout=FLUSH_WAIT_S)
    pgid = os.getpgrp()
    if pgid == os.getpid():
        # SIGTERM usually ends us right here; the SIGKILL is for handlers that ignore it.
        _send(pgid, signal.SIGTERM, True)
        time.sleep(grace)
        _send(pgid, signal.SIGKILL, True)
    else:
        kill_processes(descendant_pids(os.getpid()), signal.SIGTERM, grace)
    os._exit(exit_code)


def become_group_leader() -> None:
    """Start a new session so the supervisor can stop this rank with all its subprocesses."""
    if hasattr(os, "setsid"):
        try:
            os.setsid()
        except OSError:
            pass  # already a group leader
