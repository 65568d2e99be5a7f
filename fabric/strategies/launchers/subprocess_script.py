"""Launch the other local ranks by running the user's command again ("popen").

The process the user started becomes local rank 0. Every other local rank is the
same command started again with rank information in its environment, so it needs
nothing pickled and works for any script that can be run twice. The price is that
rank 0 is the user's own process, not a neutral supervisor, so the supervision is
split in two:

* rank 0 watches its children from a daemon thread and ends the whole job (itself
  included) as soon as one of them fails; if rank 0 itself fails, hooks on the
  interpreter (``sys.excepthook``, ``atexit``, ``SIGINT``/``SIGTERM``) kill the
  children before it goes;
* each child watches rank 0 and, should rank 0 vanish (even by ``SIGKILL``), stops
  itself together with its own subprocesses.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fabric.strategies.launchers.diagnosis import (
    JOB_DIR_ENV,
    create_job_dir,
    diagnose,
    install_stack_dump,
    record_failure,
    remove_job_dir,
)
from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.supervision import (
    KILL_GRACE_S,
    PARENT_PID_ENV,
    POLL_INTERVAL_S,
    STATUS_FD_ENV,
    describe_exit,
    descendant_pids,
    flush_stdio,
    format_rank_traceback,
    kill_process_groups,
    kill_processes,
    start_parent_watchdog,
    write_stderr,
)

__all__ = ["SubprocessScriptLauncher"]

# How long rank 0's main thread gets to unwind after Ctrl-C before it is ended hard.
_SIGINT_GRACE_S = 2.0
# After a child reports an exception, how long to look for a peer that died abruptly
# (the likelier root cause) before blaming the child that raised.
_SETTLE_S = 0.25


class SubprocessScriptLauncher(Launcher):
    """Start local ranks ``1..num_processes-1`` by re-running the current command.

    Args:
        cluster_environment: where the job runs; supplies the main address and port and
            tells whether somebody else (torchrun, SLURM, or this launcher in a parent
            process) already started the processes.
        num_processes: processes to run on this node.
        num_nodes: nodes in the job; ranks are ``node_rank * num_processes + local_rank``.

    Each child gets ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``,
    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` in its environment, plus
    ``FABRIC_PARENT_PID`` which marks it as supervised by this process.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int) -> None:
        for name, value in (("num_processes", num_processes), ("num_nodes", num_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self._supervisor: _RankZeroSupervisor | None = None

    @property
    def is_interactive_compatible(self) -> bool:
        # The children re-run `sys.argv`; a notebook or REPL has no script to re-run.
        return False

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The child processes this launcher started (empty in a child rank)."""
        return [c.proc for c in self._supervisor.children] if self._supervisor is not None else []

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the other local ranks (unless someone else did), then run ``function`` here."""
        if self.cluster_environment.creates_processes_externally:
            _supervise_as_child()
        elif self._supervisor is None:
            self._start_children()
        return function(*args, **kwargs)

    def kill(self, signum: int = signal.SIGTERM) -> None:
        """Stop every child rank and its subprocesses (no-op in a child rank).

        The calling process keeps running so it can finish raising its own error; the
        supervisor will no longer treat the children's deaths as a new failure.
        """
        if self._supervisor is not None:
            self._supervisor.stop_children(signum)

    def on_rank_failure(self, trace: str) -> None:
        """This rank raised (``trace``): diagnose and stop the job in rank 0, record it in a child.

        In rank 0 the children are asked where they are (if the error is a collective timeout, the
        report names the ranks that never arrived) and then stopped; rank 0 goes on raising. In a
        child rank the traceback is left in the job folder for rank 0's supervisor to read.
        """
        if self._supervisor is not None:
            self._supervisor.rank_zero_failed(trace)
        elif _child_supervised:
            record_failure(os.environ.get(JOB_DIR_ENV), _env_rank(), trace)

    def __getstate__(self) -> dict[str, Any]:
        # Process handles and threads cannot travel to another process.
        state = self.__dict__.copy()
        state["_supervisor"] = None
        return state

    # ----------------------------------------------------------------------------------

    def _start_children(self) -> None:
        env = self.cluster_environment
        # Read address and port once, before any child starts, so they all agree. A
        # LightningEnvironment picks a free port here and stores it in os.environ.
        main_address = str(env.main_address)
        main_port = str(env.main_port)
        node_rank = int(env.node_rank())
        os.environ["MASTER_ADDR"] = main_address
        os.environ["MASTER_PORT"] = main_port
        os.environ["NODE_RANK"] = str(node_rank)
        if self.num_processes == 1:
            return

        command = _rerun_command()
        world_size = self.num_processes * self.num_nodes
        children: list[_Child] = []
        job_dir = create_job_dir()
        try:
            for local_rank in range(1, self.num_processes):
                rank = node_rank * self.num_processes + local_rank
                read_fd, write_fd = os.pipe()
                child_env = os.environ.copy()
                child_env.update(
                    {
                        "MASTER_ADDR": main_address,
                        "MASTER_PORT": main_port,
                        "NODE_RANK": str(node_rank),
                        "LOCAL_RANK": str(local_rank),
                        "RANK": str(rank),
                        "WORLD_SIZE": str(world_size),
                        "LOCAL_WORLD_SIZE": str(self.num_processes),
                        PARENT_PID_ENV: str(os.getpid()),
                        STATUS_FD_ENV: str(write_fd),
                        JOB_DIR_ENV: job_dir,
                    }
                )
                try:
                    proc = subprocess.Popen(
                        command,
                        env=child_env,
                        cwd=os.getcwd(),
                        stdin=subprocess.DEVNULL,
                        pass_fds=(write_fd,),
                        # Own session and process group: we can kill the rank with all of
                        # its subprocesses, and a terminal's Ctrl-C reaches only rank 0,
                        # which then decides what happens to the job.
                        start_new_session=True,
                    )
                except BaseException:
                    os.close(read_fd)
                    raise
                finally:
                    os.close(write_fd)
                children.append(_Child(rank=rank, proc=proc, status_fd=read_fd))
        except BaseException:
            pids = [c.proc.pid for c in children]
            kill_process_groups(pids, reap=lambda: [c.proc.poll() for c in children])
            for child in children:
                child.close()
            remove_job_dir(job_dir)
            raise

        self._supervisor = _RankZeroSupervisor(rank=node_rank * self.num_processes, children=children, job_dir=job_dir)
        self._supervisor.start()


def _rerun_command() -> list[str]:
    """The command line that starts this script again, as the user ran it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        # Started as `python -m pkg.mod`: re-run the module, not its file, so that
        # relative imports and the package context stay the same.
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script in ("-c", "-") or not os.path.exists(script):
        raise RuntimeError(
            "The 'popen' launcher starts the other processes by running your script again, "
            f"but this process was not started from a script file (sys.argv[0] is {script!r}). "
            "Run your code as `python script.py` or `python -m package.module`, or use a "
            "launcher that does not need a script (start method 'fork' from a notebook)."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


# --------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------

_child_supervised = False


def _supervise_as_child() -> None:
    """If our launcher started this process: watch it, and label/report our failures."""
    global _child_supervised
    if _child_supervised:
        return
    marker = os.environ.get(PARENT_PID_ENV, "")
    if not marker.isdigit() or int(marker) != os.getppid():
        return  # started by torchrun, SLURM, by hand, or a grandchild that inherited the env
    _child_supervised = True
    launcher_pid = int(marker)
    rank = _env_rank()
    status_fd = _take_status_fd()
    start_parent_watchdog(rank, launcher_pid, expected_ppid=launcher_pid)
    job_dir = os.environ.get(JOB_DIR_ENV)
    # rank 0 asks for our stack (a signal) when a collective times out, to name who did not arrive
    install_stack_dump(job_dir, rank)

    previous_hook = sys.excepthook
    my_pid = os.getpid()

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if os.getpid() != my_pid:  # a forked copy of this rank (e.g. a DataLoader worker)
            previous_hook(exc_type, exc, tb)
            return
        _print_rank_exception(rank, previous_hook, exc_type, exc, tb)
        # before the status byte: rank 0 reads it to tell a collective timeout from other errors
        record_failure(job_dir, rank, "".join(traceback.format_exception(exc_type, exc, tb)))
        if status_fd is not None:
            # Tell rank 0 right away: our interpreter shutdown may take long (or hang).
            try:
                os.write(status_fd, b"E")
            except OSError:
                pass

    sys.excepthook = excepthook


def _env_rank() -> int:
    raw = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "-1"))
    return int(raw) if raw.lstrip("-").isdigit() else -1


def _take_status_fd() -> int | None:
    raw = os.environ.pop(STATUS_FD_ENV, "")
    if not raw.isdigit():
        return None
    fd = int(raw)
    try:
        os.set_inheritable(fd, False)  # our own subprocesses must not hold it open
    except OSError:
        return None
    return fd


def _print_rank_exception(
    rank: int,
    previous_hook: Callable[..., Any],
    exc_type: type[BaseException],
    exc: BaseException,
    tb: TracebackType | None,
) -> None:
    if getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
        # torch.distributed wrapped our hook after init_process_group and prefixes every
        # line with "[rankN]:" itself; a second label would only add noise.
        previous_hook(exc_type, exc, tb)
    elif previous_hook is sys.__excepthook__:
        write_stderr(format_rank_traceback(rank, exc_type, exc, tb))
    else:
        # Somebody installed a richer hook (IPython, rich, ...): keep it, add the label.
        write_stderr(f"[rank {rank}] unhandled exception:")
        previous_hook(exc_type, exc, tb)
        flush_stdio()


# --------------------------------------------------------------------------------------
# Rank 0 side
# --------------------------------------------------------------------------------------


@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen
    status_fd: int | None
    raised: bool = field(default=False)

    def close(self) -> None:
        if self.status_fd is not None:
            try:
                os.close(self.status_fd)
            except OSError:
                pass
            self.status_fd = None


class _RankZeroSupervisor:
    """Runs inside rank 0 and ends the whole job when any part of it fails.

    All decisions go through ``_lock`` and the ``_stopping`` flag so that the monitor
    thread, the excepthook, the signal handlers and the atexit hook never report the
    same failure twice or fight over the teardown. Every hook first checks that it runs
    in the process that started the children: a ``fork`` of rank 0 (a DataLoader
    worker, say) inherits the hooks but must never act for the job.
    """

    def __init__(self, rank: int, children: list[_Child], job_dir: str | None = None) -> None:
        self.rank = rank
        self.children = children
        self.job_dir = job_dir
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._stopping = False
        self._all_done = threading.Event()
        self._exit_status: int | None = None
        self._wakeup_r: int | None = None
        self._wakeup_w: int | None = None
        self._watched_signals: set[int] = set()
        self._previous_excepthook: Callable[..., Any] = sys.excepthook
        self._original_exit: Callable[..., Any] = sys.exit
        self._thread: threading.Thread | None = None

    def _in_rank0(self) -> bool:
        return os.getpid() == self._pid

    # -- setup ---------------------------------------------------------------------------

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
        """Make Ctrl-C and SIGTERM end the job even while rank 0 is stuck in C code.

        Python runs signal handlers only in the main thread, between bytecodes, so a
        rank 0 blocked in a collective would never see them. The wakeup fd is written
        by the C-level handler immediately; the monitor thread reads it and acts.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._watched_signals.add(signal.SIGINT)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, self._sigterm_handler)
            self._watched_signals.add(signal.SIGTERM)
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous is None or previous != -1:
            # Somebody else (an event loop) owns the wakeup fd: leave it to them and rely
            # on the Python-level handlers alone.
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup_r, self._wakeup_w = read_fd, write_fd

    def _after_fork_in_child(self) -> None:
        """A fork of rank 0 must not feed our wakeup pipe nor run our SIGTERM teardown."""
        if self._in_rank0():
            return
        try:
            if self._wakeup_w is not None:
                previous = signal.set_wakeup_fd(-1)
                if previous != self._wakeup_w:
                    signal.set_wakeup_fd(previous)  # not ours any more: leave it alone
            if signal.getsignal(signal.SIGTERM) == self._sigterm_handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):
            pass

    # -- hooks -----------------------------------------------------------------------------

    def _recording_exit(self, status: Any = None, /) -> Any:
        if self._in_rank0():
            self._exit_status = 0 if status is None else (status if isinstance(status, int) else 1)
        return self._original_exit(status)

    def _sigterm_handler(self, signum: int, frame: Any) -> None:
        if not self._in_rank0():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._abort_for_signal(signum)

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if not self._in_rank0():
            self._previous_excepthook(exc_type, exc, tb)
            return
        _print_rank_exception(self.rank, self._previous_excepthook, exc_type, exc, tb)
        self._stop_job(f"rank {self.rank} failed", own_trace="".join(traceback.format_exception(exc_type, exc, tb)))

    def rank_zero_failed(self, trace: str) -> None:
        """Rank 0's code raised (reported by the strategy): diagnose, stop the children, keep running."""
        if self._in_rank0():
            self._stop_job(f"rank {self.rank} failed", own_trace=trace, kill_own=False)

    def _stop_job(self, reason: str, own_trace: str | None = None, kill_own: bool = True) -> None:
        """Rank 0 is going down on its own terms: take the children (and ours) along."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                # Rank 0's error may only echo a child's death ("connection closed by
                # peer"): if a child failed too, that is the news worth reporting.
                cause = self._settled_cause()
                if cause is not None:
                    reason = self._describe(cause)
                alive = self._alive_children()
                if alive or cause is not None:
                    write_stderr(f"[fabric] {reason}; stopping the other {len(alive)} local rank(s)")
                self._report_diagnosis({self.rank: own_trace} if own_trace is not None else {}, own_alive=False)
                self._kill_children()
                remove_job_dir(self.job_dir)
        if not kill_own:
            return
        with self._lock:
            # Also after a deliberate kill(): rank 0's own subprocesses must not outlive it.
            self._kill_own_subprocesses()

    def _at_exit(self) -> None:
        if not self._in_rank0():
            return
        try:
            if self._exit_status not in (None, 0):
                self._stop_job(f"rank {self.rank} is exiting with status {self._exit_status}")
                return
            if getattr(sys, "last_value", None) is not None:
                # An unhandled exception even though our excepthook was replaced.
                self._stop_job(f"rank {self.rank} failed")
                return
            # Rank 0 is done: the job is done when every rank is. The monitor thread ends
            # the process (non-zero) should a child fail while we wait.
            while not self._all_done.wait(POLL_INTERVAL_S):
                if self._stopping:
                    return
                if self._thread is None or not self._thread.is_alive():
                    self._check_children()
        except KeyboardInterrupt:
            self._abort_for_signal(signal.SIGINT, grace=0.0)

    # -- monitoring ------------------------------------------------------------------------

    def _monitor(self) -> None:
        while not self._all_done.is_set():
            readable = _wait_readable(
                [c.status_fd for c in self.children if c.status_fd is not None]
                + ([self._wakeup_r] if self._wakeup_r is not None else []),
                POLL_INTERVAL_S,
            )
            if self._wakeup_r is not None and self._wakeup_r in readable:
                self._handle_wakeup()
            for child in self.children:
                if child.status_fd is not None and child.status_fd in readable:
                    try:
                        data = os.read(child.status_fd, 64)
                    except OSError:
                        data = b""
                    if b"E" in data:
                        child.raised = True
                    if not data:
                        child.close()
            self._check_children()
        # All children finished cleanly. From here on rank 0 is an ordinary process:
        # Ctrl-C is just a KeyboardInterrupt again and nobody needs to read the wakeup pipe
        # (it is non-blocking; once full, further bytes are dropped silently).

    def _handle_wakeup(self) -> None:
        assert self._wakeup_r is not None
        try:
            data = os.read(self._wakeup_r, 512)
        except OSError:
            return
        for signum in data:
            if signum in self._watched_signals:
                self._abort_for_signal(signum)

    def _check_children(self) -> None:
        """Fail the job if any child failed; note when all of them finished cleanly."""
        if self._stopping:
            return
        died, raised, finished = self._classify()
        if died or raised:
            cause = self._settled_cause()
            self._fail(cause if cause is not None else (died or raised)[0])
        elif finished == len(self.children):
            for child in self.children:
                child.close()
            remove_job_dir(self.job_dir)
            self._all_done.set()

    def _classify(self) -> tuple[list[_Child], list[_Child], int]:
        """(children that died without raising, children that raised, count finished OK)."""
        died, raised, finished = [], [], 0
        for child in self.children:
            code = child.proc.poll()
            if child.raised:
                raised.append(child)
            elif code is not None and code != 0:
                died.append(child)
            elif code == 0:
                finished += 1
        return died, raised, finished

    def _settled_cause(self) -> _Child | None:
        """The child most likely at the root of a failure, after a short settling wait.

        An exception is often the echo of a peer's abrupt death (a signal, ``os._exit``)
        and can arrive first; so a child that died without raising is preferred, and if
        none has yet, we look again for up to ``_SETTLE_S`` seconds.
        """
        deadline = time.monotonic() + _SETTLE_S
        while True:
            died, raised, _ = self._classify()
            if died or time.monotonic() >= deadline or not self._alive_children():
                break
            time.sleep(0.02)
        if died:
            return died[0]
        # among children that raised, the first to raise is the cause; its peers' errors can only follow
        return min(raised, key=self._raised_at) if raised else None

    def _raised_at(self, child: _Child) -> tuple[float, int]:
        """When ``child`` recorded its failure (the file's mtime), for ordering causes before echoes."""
        try:
            recorded = os.stat(os.path.join(self.job_dir or "", f"failure-rank{child.rank}.txt")).st_mtime
        except OSError:
            recorded = float("inf")
        return recorded, child.rank

    def _describe(self, child: _Child) -> str:
        what = describe_exit(child.rank, child.proc.poll(), raised=child.raised)
        if child.raised:
            what += " (traceback above)"
        return f"{what}, pid {child.proc.pid}"

    def _fail(self, child: _Child) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            # Every other rank: the other children and rank 0.
            others = len(self.children)
            write_stderr(f"[fabric] {self._describe(child)}; stopping the other {others} local rank(s)")
            self._report_diagnosis({}, own_alive=True)
            self._teardown()
            remove_job_dir(self.job_dir)
            flush_stdio()
            os._exit(1)

    def _abort_for_signal(self, signum: int, grace: float | None = None) -> None:
        """Ctrl-C / SIGTERM: stop the children, then end rank 0 with 128 + signum."""
        with self._lock:
            first = not self._stopping
            self._stopping = True
            if first:
                name = signal.Signals(signum).name
                write_stderr(f"[fabric] rank {self.rank} received {name}; stopping all ranks")
                self._teardown()
                remove_job_dir(self.job_dir)
        if grace is None:
            grace = _SIGINT_GRACE_S if signum == signal.SIGINT else 0.0
        if grace > 0 and threading.current_thread() is not threading.main_thread():
            # Give the main thread the chance to unwind (finally blocks, KeyboardInterrupt).
            threading.Event().wait(grace)
        flush_stdio()
        os._exit(128 + signum)

    # -- teardown --------------------------------------------------------------------------

    def stop_children(self, signum: int = signal.SIGTERM) -> None:
        """Kill every child rank's process group; later deaths are no longer failures."""
        if not self._in_rank0():
            return
        with self._lock:
            self._stopping = True
            self._kill_children(signum)
            remove_job_dir(self.job_dir)

    def _report_diagnosis(self, raised: dict[int, str], own_alive: bool) -> None:
        """If a collective timed out: print which ranks did not arrive and where every rank was.

        Runs before any rank is stopped, while the stuck ones can still be asked for their stacks.
        """
        live = {c.rank: c.proc.pid for c in self._alive_children()}
        if own_alive:
            live[self.rank] = os.getpid()
        try:
            report = diagnose(self.job_dir, live, raised, own_rank=self.rank if own_alive else None)
        except Exception as err:  # a diagnosis must never stand in the way of the teardown
            report = f"fabric: could not diagnose the failure ({type(err).__name__}: {err})"
        if report:
            write_stderr(report)

    def _alive_children(self) -> list[_Child]:
        return [c for c in self.children if c.proc.poll() is None]

    def _reap(self) -> None:
        for child in self.children:
            child.proc.poll()

    def _kill_children(self, signum: int = signal.SIGTERM) -> None:
        # The status pipes stay open: only the monitor thread closes them, so it never
        # polls a descriptor number that was closed and reused meanwhile.
        pids = [c.proc.pid for c in self.children]
        kill_process_groups(pids, signum=signum, grace=KILL_GRACE_S, reap=self._reap)

    def _teardown(self) -> None:
        """Rank 0 is about to end: stop the children and rank 0's own subprocesses."""
        self._kill_children()
        self._kill_own_subprocesses()

    def _kill_own_subprocesses(self) -> None:
        """Rank 0 is going down: take its own subprocesses (not the mp helpers) with it."""
        if threading.current_thread() is threading.main_thread():
            # Stop e.g. DataLoader's SIGCHLD handler from raising while we kill its workers.
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            except (ValueError, OSError, AttributeError):
                pass
        keep = _multiprocessing_helper_pids() | {c.proc.pid for c in self.children}
        pids = descendant_pids(os.getpid(), exclude=keep)
        if pids:
            kill_processes(pids, grace=KILL_GRACE_S)


def _wait_readable(fds: list[int], timeout: float) -> list[int]:
    """The fds in ``fds`` that are readable, waiting up to ``timeout`` seconds.

    ``poll`` rather than ``select``: a big job can have descriptors above 1023.
    """
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
