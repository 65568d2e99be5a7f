"""Launch ranks as child processes of this one ("spawn", "fork", "forkserver").

Unlike the popen launcher, the launching process is not a rank: it starts ``num_processes`` workers,
watches them with the job's :class:`~fabric.supervision.supervisor.Supervisor`, and hands the
return value of process 0 back to the caller. A worker is a :class:`WorkerRank` handle: its sentinel
says when it ended, and a pipe carries its result or its traceback.
"""

from __future__ import annotations

import copyreg
import functools
import io
import multiprocessing as _mp
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection
from typing import Any

from fabric._core.env import export_rendezvous, global_rank
from fabric._core.process_end import HARD_END_WAIT_S, run_process_end_callbacks
from fabric._core.processes import become_group_leader
from fabric.strategies.launchers.launcher import Launcher, share_cores_with_torch
from fabric.supervision.diagnosis import install_stack_dump, record_failure
from fabric.supervision.failure_report import full_tracebacks
from fabric.supervision.rank_side import (
    exit_status_of,
    follow_supervisor,
    format_rank_traceback,
    record_exception,
    write_stderr,
)
from fabric.supervision.supervisor import RankFailedError, Supervisor, only_in_this_process

__all__ = ["MultiprocessingLauncher", "RankFailedError"]

_START_METHODS = ("spawn", "fork", "forkserver")


class MultiprocessingLauncher(Launcher):
    """Run the function in ``strategy.num_processes`` new processes and return rank 0's result.

    Args:
        strategy: provides ``num_processes``, ``num_nodes``, ``cluster_environment`` and
            ``setup_worker(process_idx)``, which each worker calls before the function
            (it sets the ranks and joins the process group).
        start_method: ``"spawn"`` (default, safe everywhere), ``"fork"`` (the only one
            that works from a notebook, since nothing is pickled) or ``"forkserver"``.

    The return value of process 0 travels back through ``torch.save``/``torch.load``, so
    tensors (also CPU tensors) and nested structures of them come back intact. If a
    worker fails, the others are stopped and :class:`RankFailedError` is raised with
    the rank, how it ended and its traceback.
    """

    def __init__(self, strategy: Any, start_method: str = "spawn") -> None:
        if start_method not in _START_METHODS:
            raise ValueError(
                f"Invalid start_method {start_method!r}; expected one of "
                + ", ".join(repr(m) for m in _START_METHODS)
            )
        available = _mp.get_all_start_methods()
        if start_method not in available:
            raise ValueError(
                f"start_method {start_method!r} is not available on this platform "
                f"(available: {', '.join(repr(m) for m in available)})"
            )
        self._strategy = strategy
        self._start_method = start_method
        self._supervisor: Supervisor | None = None

    @property
    def start_method(self) -> str:
        return self._start_method

    @property
    def requires_function(self) -> bool:
        # The workers have nothing to run but the function: launch() without one is an error.
        return True

    @property
    def is_interactive_compatible(self) -> bool:
        # spawn/forkserver re-import the function by name from __main__, which a
        # notebook does not have; fork copies the process and pickles nothing.
        return self._start_method == "fork"

    @property
    def procs(self) -> list[Any]:
        """The worker processes of the running job (empty when none is running)."""
        if self._supervisor is None:
            return []
        return [handle.proc for handle in self._supervisor.ranks if isinstance(handle, WorkerRank)]

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the workers, wait for all of them, and return process 0's result."""
        if self._start_method != "fork":
            _check_picklable(function, args, kwargs, self._strategy, self._start_method)

        env = self._strategy.cluster_environment
        # Exported before the workers start so they inherit one address and port.
        export_rendezvous(env.main_address, env.main_port)
        share_cores_with_torch(int(self._strategy.num_processes))  # the workers inherit the variable
        try:
            node_rank = int(env.node_rank())
        except Exception:
            node_rank = 0

        import torch.multiprocessing as tmp  # lazily: importing torch is expensive

        context: Any = tmp.get_context(self._start_method)
        num_processes = int(self._strategy.num_processes)
        launcher_pid = os.getpid()
        first = global_rank(node_rank, num_processes, 0)

        def start_worker(rank: int, job_dir: str) -> WorkerRank:
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=_worker,
                args=(rank - first, rank, launcher_pid, self._strategy, function, args, kwargs, writer, job_dir),
                name=f"fabric-rank-{rank}",
                daemon=False,  # daemonic processes may not start DataLoader workers
            )
            handle = WorkerRank(rank, proc, reader)
            proc.start()
            writer.close()
            return handle

        supervisor = Supervisor(start_worker, range(first, first + num_processes))
        self._supervisor = supervisor
        restore_sigterm = _raise_on_sigterm()
        report = None
        try:
            result = supervisor.run()  # whatever happens (failure, Ctrl-C, SIGTERM), nothing of the job survives
            if result.failure is not None:  # read from the job folder, before it goes
                report = supervisor.failure_report(result.failure, running=(), with_pids=False)
        except KeyboardInterrupt as interrupt:  # Ctrl-C: the workers are stopped (run() does it); one line says so
            write_stderr(f"[fabric] received SIGINT; stopped {len(supervisor.rank_ids)} rank(s)")
            _quiet_when_uncaught(interrupt)
            raise
        finally:
            self._supervisor = None
            supervisor.close()
            restore_sigterm()
        if result.failure is not None:
            failure = result.failure
            _end_with_the_rank_status_when_uncaught()
            raise RankFailedError(failure.rank, failure.exitcode, failure.traceback, diagnosis=result.diagnosis, report=report)
        payload = supervisor.rank(first).result  # type: ignore[attr-defined]  # a WorkerRank: it carries the result
        return None if payload is None else _deserialize(payload)

    def kill(self, signum: int = signal.SIGTERM) -> None:
        """Stop all workers of the running job (no-op inside a worker).

        A worker's own failure needs no call: the launching process notices it and stops
        the rest of the job.
        """
        if self._supervisor is not None:
            self._supervisor.stop(signum)

    def on_rank_failure(self, trace: str) -> None:
        """A worker's code raised (``trace``): leave it for the launching process's diagnosis.

        The launching process stops the job as soon as the worker reports the error; before it does,
        it reads every failure recorded here and, for a collective timeout, asks the live workers
        where they are. Called in the launching process itself, it stops the running job.
        """
        if _worker_context is not None:
            record_failure(*_worker_context, trace)
        else:
            self.kill()

    def __getstate__(self) -> dict[str, Any]:
        # The strategy (and this launcher with it) is pickled into every worker under
        # spawn; process handles cannot be, nor are they of any use there.
        state = self.__dict__.copy()
        state["_supervisor"] = None
        return state


# --------------------------------------------------------------------------------------
# Pickling checks and result transport
# --------------------------------------------------------------------------------------


class _ProbePickler(pickle.Pickler):
    """Pickles like multiprocessing would, but skips tensors (big, and always picklable)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        from multiprocessing.reduction import ForkingPickler

        # Reducers multiprocessing registers (connections, sockets, ...), minus torch's
        # shared-memory tensor reducers, which would move storages as a side effect.
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(getattr(ForkingPickler, "_extra_reducers", {}))

    def persistent_id(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


def _probe_pickle(obj: Any) -> None:
    _ProbePickler(io.BytesIO()).dump(obj)


def _check_picklable(function: Any, args: tuple, kwargs: dict, strategy: Any, start_method: str) -> None:
    """Fail before starting anything if the workers could not receive what they need."""
    advice = (
        "Define the function at the top level of an importable module (not a lambda, a "
        "nested function, or a method of an object that cannot be pickled), or use "
        "start_method='fork' (strategy 'ddp_fork'), or the 'ddp' strategy, which runs your "
        "script again in each process instead of pickling the function."
    )
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and main_file and not os.path.exists(main_file):
        raise RuntimeError(
            f"start_method={start_method!r} re-imports the main module in every worker, but "
            f"this program's __main__ does not come from a file ({main_file!r}). Run it from a "
            "script file, or use start_method='fork' (strategy 'ddp_fork')."
        )
    # Fabric.launch hands over a functools.partial around the user's function, so look inside it.
    for candidate in (*_wrapped_callables(function), function):
        if getattr(candidate, "__module__", None) == "__main__" and not main_file:
            raise RuntimeError(
                f"The function passed to launch() ({_name_of(candidate)}) is defined in an interactive "
                f"session or a `python -c` program, which start_method={start_method!r} cannot import it "
                f"from in the worker processes. {advice}"
            )
    try:
        # The user's own function first, so that the error names it and not a wrapper
        # (Fabric.launch passes a functools.partial around it).
        for candidate in (*_wrapped_callables(function), function):
            culprit = candidate
            _probe_pickle(candidate)
    except Exception as err:
        raise RuntimeError(
            f"The function passed to launch() ({_name_of(culprit)}) could not be pickled, "
            f"which start_method={start_method!r} needs to send it to the worker processes: "
            f"{type(err).__name__}: {err}. {advice}"
        ) from err
    for what, obj in (("arguments passed to launch()", (args, kwargs)), ("strategy", strategy)):
        try:
            _probe_pickle(obj)
        except Exception as err:
            raise RuntimeError(
                f"The {what} could not be pickled, which start_method={start_method!r} needs "
                f"to send them to the worker processes: {type(err).__name__}: {err}. Pass "
                "picklable objects, or use start_method='fork' (strategy 'ddp_fork') or the "
                "'ddp' strategy, which do not pickle them."
            ) from err


def _wrapped_callables(function: Any) -> list[Any]:
    """Callables a ``functools.partial`` carries (its arguments, then its function)."""
    if isinstance(function, functools.partial):
        inner = [a for a in function.args if callable(a)]
        return [*(c for a in inner for c in (*_wrapped_callables(a), a)), function.func]
    return []


def _name_of(function: Any) -> str:
    if isinstance(function, functools.partial):
        inner = [a for a in function.args if callable(a)]
        return _name_of(inner[0] if inner else function.func)
    return getattr(function, "__qualname__", None) or repr(function)


def _serialize(result: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _deserialize(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------


# (job folder, rank) in a worker process; None in the launching process
_worker_context: tuple[str, int] | None = None


def _worker(
    process_idx: int,
    rank: int,
    launcher_pid: int,
    strategy: Any,
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    conn: Connection,
    job_dir: str,
) -> None:
    """Entry point of every worker process."""
    global _worker_context
    become_group_leader()
    # Under fork we inherit the launcher's temporary handlers; a worker wants defaults.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    follow_supervisor(rank, launcher_pid)
    _worker_context = (job_dir, rank)
    # the launching process asks for our stack (a signal) when a collective times out
    install_stack_dump(job_dir, rank)
    try:
        strategy.setup_worker(process_idx)
        result = function(*args, **kwargs)
        payload = None
        if process_idx == 0 and result is not None:
            try:
                payload = _serialize(result)
            except Exception as err:
                raise RuntimeError(
                    "The function finished, but its return value could not be sent back to the "
                    f"launching process (it is serialized with torch.save): {type(err).__name__}: {err}"
                ) from err
    except SystemExit as end:
        # sys.exit(n) in a worker: its code is its exit status, as usual. Reported with the time it began,
        # which comes before its interpreter shutdown closes its connections: the peers' errors that
        # follow ("connection closed by peer") are echoes, never the cause (as ``rank_side.report_exit``)
        began = time.monotonic()
        run_process_end_callbacks(timeout=HARD_END_WAIT_S)
        try:
            conn.send(("exit", exit_status_of(end.code), began))
        except Exception:
            pass
        raise
    except BaseException as err:
        record_exception(job_dir, rank, err)  # the whole traceback and the brief one, for the launcher's report
        text = format_rank_traceback(rank, type(err), err, err.__traceback__)
        # before the report: once it is sent, the launcher stops every worker, this one too
        run_process_end_callbacks(timeout=HARD_END_WAIT_S)
        try:
            # when it raised (a clock all processes share): the cause raises before its echoes
            conn.send(("error", text, time.monotonic()))
        except Exception:
            sys.stderr.write(text)
        sys.exit(1)
    # multiprocessing ends a fork or forkserver worker with os._exit, which skips atexit: what must reach
    # disk (the loggers' last rows and events) is written here, before the launcher hears that we are done
    run_process_end_callbacks(timeout=HARD_END_WAIT_S)
    conn.send(("ok", payload))


# --------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------


class WorkerRank:
    """A worker process as the supervisor sees it (a ``RankProcess``)."""

    def __init__(self, rank: int, proc: Any, conn: Connection) -> None:
        self.rank = rank
        self.proc = proc
        self.raised_at: float | None = None
        self.traceback: str | None = None
        self.result: bytes | None = None  # what process 0 returned, serialized
        #: (status, when) the worker reported as it began to exit through ``sys.exit`` (see ``reported_exit``)
        self.exiting: tuple[int | None, float] | None = None
        self._conn: Connection | None = conn

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def poll(self) -> int | None:
        code = self.proc.exitcode
        if code is not None:
            self._receive()  # a worker's message arrives just before its exit
        return code

    def fds(self) -> list[int]:
        if self.proc.pid is None or self.proc.exitcode is not None:
            return []
        return [self.proc.sentinel] + ([self._conn.fileno()] if self._conn is not None else [])

    def take_reports(self, ready: Collection[int]) -> None:
        if self._conn is not None and self._conn.fileno() in ready:
            self._receive()
        if self.proc.pid is not None and self.proc.sentinel in ready:
            # A readable sentinel means the process is exiting; join() collects its status (a
            # non-blocking poll could still miss it for a moment).
            self.proc.join()
            self._receive()

    def _receive(self) -> None:
        conn = self._conn
        if conn is None or not conn.poll(0):
            return
        self._conn = None  # a worker sends one message at most
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        finally:
            conn.close()
        if message is not None and message[0] == "error":
            self.traceback, self.raised_at = message[1], float(message[2])
        elif message is not None and message[0] == "exit":
            self.exiting = (message[1], float(message[2]))
        elif message is not None:
            self.result = message[1]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.proc.pid is not None:
            self.proc.join(timeout=0)


def _end_with_the_rank_status_when_uncaught() -> None:
    """Have a :class:`RankFailedError` that nothing catches end the program with the failed rank's status.

    Python ends a program on an uncaught exception with status 1, whatever it was; ``fabric-torch run``
    and the popen launcher end a job with its failed rank's own status (``sys.exit(3)`` in rank 1: 3;
    a rank killed by SIGKILL: 137). The error stays an ordinary exception for code that catches it: only
    once it reached the top and its traceback was printed does the hook end the program with
    :attr:`RankFailedError.exit_status` (a ``SystemExit`` raised by ``sys.excepthook`` ends the
    interpreter as usual, ``atexit`` included). Not in an interactive session, whose loop shows every
    error through ``sys.excepthook`` and goes on, nor in a forked copy of this process.
    """
    previous = sys.excepthook
    if getattr(previous, "_fabric_rank_status", False):
        return  # installed by an earlier launch
    owner = os.getpid()

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        if not isinstance(exc, RankFailedError) or os.getpid() != owner:
            return
        if hasattr(sys, "ps1") or sys.flags.interactive:
            return
        if exc.exit_status != 1:
            raise SystemExit(exc.exit_status)

    excepthook._fabric_rank_status = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _quiet_when_uncaught(told: BaseException) -> None:
    """Have ``told`` (a Ctrl-C the launcher has said in one line) end the program without its traceback, should
    nothing catch it (``FABRIC_FULL_TRACEBACKS=1``: with it). It stays an ordinary exception for code that does."""
    previous = sys.excepthook
    owner = os.getpid()

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if exc is told and os.getpid() == owner and not full_tracebacks():
            return
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def _raise_on_sigterm() -> Callable[[], object]:
    """While the job runs, turn SIGTERM into SystemExit(143) so cleanup code runs.

    Only done from the main thread and only if nobody handles SIGTERM already; returns a function
    that restores the previous state.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, only_in_this_process(handler))
    return lambda: signal.signal(signal.SIGTERM, previous)
