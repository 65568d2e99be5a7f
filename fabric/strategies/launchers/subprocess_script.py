"""Launch the other local ranks by running the user's command again ("popen").

The process the user started becomes local rank 0. Every other local rank is the same command started
again with rank variables in its environment, so nothing is pickled and any script that can be run
twice works. The price is that rank 0 is the user's own process, not a neutral supervisor, so the job's
:class:`~fabric.supervision.supervisor.Supervisor` runs inside rank 0:

* a daemon thread waits on the supervisor and ends the whole job (rank 0 included) as soon as another
  rank fails; if rank 0 itself fails, hooks on the interpreter (``sys.excepthook``, ``atexit``,
  ``SIGINT``/``SIGTERM``) stop the other ranks before it goes;
* each other rank follows rank 0 (``rank_side.follow_supervisor``): should rank 0 vanish, even by
  ``SIGKILL``, it stops itself together with its own subprocesses.

The same child side serves ranks started by ``fabric run``, whose supervisor is the CLI.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from fabric._core.env import (
    JOB_DIR_ENV,
    STATUS_FD_ENV,
    SUPERVISOR_PID_ENV,
    export_rendezvous,
    global_rank,
    rank_environment,
)
from fabric.plugins.environments import rank_from_environment
from fabric.strategies.launchers.launcher import Launcher, share_cores_with_torch
from fabric.supervision.command_rank import CommandRank
from fabric.supervision.diagnosis import install_stack_dump, record_failure
from fabric.supervision.failure_report import brief_traceback, full_tracebacks, record_brief
from fabric.supervision.rank_side import (
    exit_status_of,
    follow_supervisor,
    print_rank_exception,
    record_exception,
    report_exit,
    report_raise,
)
from fabric.supervision.rank_zero import RankZeroSupervision
from fabric.supervision.supervisor import Supervisor

__all__ = ["SubprocessScriptLauncher"]


class SubprocessScriptLauncher(Launcher):
    """Start local ranks ``1..num_processes-1`` by re-running the current command.

    Args:
        cluster_environment: where the job runs; supplies the main address and port and tells whether
            somebody else (torchrun, SLURM, ``fabric run``, or this launcher in a parent process)
            already started the processes.
        num_processes: processes to run on this node.
        num_nodes: nodes in the job.

    Each child gets torchrun's rank variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ...) plus ``FABRIC_PARENT_PID``, which marks it as supervised by
    this process.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int) -> None:
        for name, value in (("num_processes", num_processes), ("num_nodes", num_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self._rank_zero: RankZeroSupervision | None = None

    @property
    def is_interactive_compatible(self) -> bool:
        # The children re-run `sys.argv`; a notebook or REPL has no script to re-run.
        return False

    @property
    def procs(self) -> list[Any]:
        """The child processes this launcher started (empty in a child rank)."""
        if self._rank_zero is None:
            return []
        return [handle.proc for handle in self._rank_zero.supervisor.ranks if isinstance(handle, CommandRank)]

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the other local ranks (unless someone else did), then run ``function`` here."""
        if self.cluster_environment.creates_processes_externally:
            _supervise_as_child()
        elif self._rank_zero is None:
            self._start_children()
        return function(*args, **kwargs)

    def kill(self, signum: int = signal.SIGTERM) -> None:
        """Stop every child rank and its subprocesses (no-op in a child rank).

        The calling process keeps running so it can finish raising its own error; later deaths of the
        children are no longer treated as a new failure.
        """
        if self._rank_zero is not None:
            self._rank_zero.stop_children(signum)

    def on_rank_failure(self, trace: str) -> None:
        """This rank raised (``trace``): diagnose and stop the job in rank 0, record it in a child.

        In rank 0 the children are asked where they are (if the error is a collective timeout, the
        report names the ranks that never arrived) and then stopped; rank 0 goes on raising. In a
        child rank the traceback is left in the job folder for the supervisor to read.
        """
        handled = sys.exc_info()[1]  # the strategy reports the exception it is handling
        if self._rank_zero is not None:
            self._rank_zero.rank_zero_failed(trace, handled)
        elif _child_supervised:
            job_dir, rank = os.environ.get(JOB_DIR_ENV), rank_from_environment()
            record_failure(job_dir, rank, trace)
            if handled is not None:
                record_brief(job_dir, rank, brief_traceback(handled))

    def __getstate__(self) -> dict[str, Any]:
        # Process handles and threads cannot travel to another process.
        state = self.__dict__.copy()
        state["_rank_zero"] = None
        return state

    def _start_children(self) -> None:
        env = self.cluster_environment
        # Read address and port once and export them before any child starts, so they all agree (a
        # LightningEnvironment picks a free port here).
        main_address, main_port = str(env.main_address), int(env.main_port)
        node_rank = int(env.node_rank())
        export_rendezvous(main_address, main_port)
        os.environ["NODE_RANK"] = str(node_rank)
        share_cores_with_torch(self.num_processes)  # before the children start: they inherit the variable
        if self.num_processes == 1:
            return
        command = _rerun_command()
        parent_env = dict(os.environ)
        cwd = os.getcwd()

        first = global_rank(node_rank, self.num_processes, 0)

        def start_rank(rank: int, job_dir: str) -> CommandRank:
            ranks = rank_environment(main_address, main_port, node_rank, self.num_nodes, self.num_processes, rank - first)
            return CommandRank(rank, command, {**parent_env, **ranks}, job_dir, cwd=cwd)

        supervisor = Supervisor(start_rank, range(first + 1, first + self.num_processes), own_rank=first)
        supervisor.start()
        self._rank_zero = RankZeroSupervision(supervisor)
        self._rank_zero.start()


def _rerun_command() -> list[str]:
    """The command line that starts this script again, as the user ran it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        # Started as `python -m pkg.mod`: re-run the module, not its file, so that relative imports and
        # the package context stay the same.
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
# Child side (also for ranks started by `fabric run`)
# --------------------------------------------------------------------------------------

_child_supervised = False


def _supervise_as_child() -> None:
    """If a fabric supervisor started this process: follow it, and label and report our failures."""
    global _child_supervised
    if _child_supervised:
        return
    marker = os.environ.get(SUPERVISOR_PID_ENV, "")
    if not marker.isdigit() or int(marker) != os.getppid():
        return  # started by torchrun, SLURM, by hand, or a grandchild that inherited the env
    _child_supervised = True
    supervisor_pid = int(marker)
    rank = rank_from_environment()
    status_fd = _take_status_fd()
    follow_supervisor(rank, supervisor_pid, expected_ppid=supervisor_pid)
    job_dir = os.environ.get(JOB_DIR_ENV)
    # the supervisor asks for our stack (a signal) when a collective times out, to name who did not arrive
    install_stack_dump(job_dir, rank)

    previous_hook = sys.excepthook
    my_pid = os.getpid()
    raised: list[bool] = []

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if os.getpid() != my_pid:  # a forked copy of this rank (e.g. a DataLoader worker)
            previous_hook(exc_type, exc, tb)
            return
        # before the status report: the supervisor reads it to report the failure once, for every rank that met
        # it, and to tell a collective timeout from other errors; the rank prints its own only where asked
        if record_exception(job_dir, rank, exc) is None or full_tracebacks():
            print_rank_exception(rank, previous_hook, exc_type, exc, tb)
        raised.append(True)
        report_raise(status_fd)  # right away: our interpreter shutdown may take long (or hang)

    sys.excepthook = excepthook
    _report_exit_first(status_fd, my_pid, raised)


def _report_exit_first(status_fd: int | None, my_pid: int, raised: list[bool]) -> None:
    """Report this rank's exit (and its ``sys.exit`` status) before anything of the shutdown runs.

    The threading module's exit callbacks run before every ``atexit`` hook, so the report goes out before
    the process group is left (ours is an ``atexit`` hook) and the peers see the connection close.
    """
    status: list[int | None] = [None]
    original_exit = sys.exit

    def recording_exit(code: object = None, /) -> Any:
        if os.getpid() == my_pid:
            status[0] = exit_status_of(code)
        return original_exit(code)  # type: ignore[arg-type]

    def at_shutdown() -> None:
        if os.getpid() == my_pid and not raised:
            # without sys.exit the script ran to its end (0); a bare ``raise SystemExit(n)`` is seen as the
            # process ends, unless the job is stopped first
            report_exit(status_fd, status[0] if status[0] is not None else 0)

    sys.exit = recording_exit
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(at_shutdown)


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
