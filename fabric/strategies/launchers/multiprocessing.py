"""Launch ranks as child processes of this one ("spawn", "fork", "forkserver").

Unlike the popen launcher, the launching process is not a rank: it starts
``num_processes`` workers, supervises them, and hands the return value of process 0
back to the caller. Because it sits outside the job it can always tell which rank
failed first and why, and it never has to end itself to stop the others.
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
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from fabric.strategies.launchers.diagnosis import (
    create_job_dir,
    diagnose,
    install_stack_dump,
    record_failure,
    remove_job_dir,
)
from fabric.strategies.launchers.launcher import Launcher
from fabric.strategies.launchers.supervision import (
    KILL_GRACE_S,
    RankFailedError,
    become_group_leader,
    format_rank_traceback,
    kill_process_groups,
    start_parent_watchdog,
)

__all__ = ["MultiprocessingLauncher", "RankFailedError"]

_START_METHODS = ("spawn", "fork", "forkserver")
# After a rank reports an exception, how long to look for a peer that died abruptly
# (the likelier root cause) before blaming the rank that raised.
_SETTLE_S = 0.25


class MultiprocessingLauncher(Launcher):
    """Run the function in ``strategy.num_processes`` new processes and return rank 0's result.

    Args:
        strategy: provides ``num_processes``, ``num_nodes``, ``cluster_environment`` and
            ``_worker_setup(process_idx)``, which each worker calls before the function
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
        self._job: _Job | None = None

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
        return list(self._job.procs) if self._job is not None else []

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the workers, wait for all of them, and return process 0's result."""
        if self._start_method != "fork":
            _check_picklable(function, args, kwargs, self._strategy, self._start_method)

        env = self._strategy.cluster_environment
        # Exported before the workers start so they inherit one address and port.
        os.environ["MASTER_ADDR"] = str(env.main_address)
        os.environ["MASTER_PORT"] = str(env.main_port)
        try:
            node_rank = int(env.node_rank())
        except Exception:
            node_rank = 0

        import torch.multiprocessing as tmp  # lazily: importing torch is expensive

        job = _Job(
            context=tmp.get_context(self._start_method),
            num_processes=int(self._strategy.num_processes),
            rank_offset=node_rank * int(self._strategy.num_processes),
            job_dir=create_job_dir(),
        )
        self._job = job
        try:
            payload = job.run(self._strategy, function, args, kwargs)
        finally:
            self._job = None
            remove_job_dir(job.job_dir)
        if payload is None:
            return None
        return _deserialize(payload)

    def kill(self, signum: int = signal.SIGTERM) -> None:
        """Stop all workers of the running job (no-op inside a worker).

        A worker's own failure needs no call: the launching process notices it and stops
        the rest of the job.
        """
        if self._job is not None:
            self._job.kill(signum)

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
        state["_job"] = None
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
    if getattr(function, "__module__", None) == "__main__" and not main_file:
        raise RuntimeError(
            f"The function passed to launch() ({_name_of(function)}) is defined in an interactive "
            f"session, which start_method={start_method!r} cannot import it from in the worker "
            f"processes. {advice}"
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
    job_dir: str | None = None,
) -> None:
    """Entry point of every worker process."""
    global _worker_context
    become_group_leader()
    # Under fork we inherit the launcher's temporary handlers; a worker wants defaults.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    start_parent_watchdog(rank, launcher_pid)
    if job_dir is not None:
        _worker_context = (job_dir, rank)
        # the launching process asks for our stack (a signal) when a collective times out
        install_stack_dump(job_dir, rank)
    try:
        strategy._worker_setup(process_idx)
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
    except SystemExit:
        raise  # sys.exit(n) in a worker: its code is its exit status, as usual
    except BaseException as err:
        if job_dir is not None:
            record_failure(job_dir, rank, "".join(traceback.format_exception(type(err), err, err.__traceback__)))
        text = format_rank_traceback(rank, type(err), err, err.__traceback__)
        try:
            # when it raised (a clock all processes share): the cause raises before its echoes
            conn.send(("error", text, time.monotonic()))
        except Exception:
            sys.stderr.write(text)
        sys.exit(1)
    conn.send(("ok", payload))


# --------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------


class _Job:
    """One run of the workers: start, supervise, collect, tear down."""

    def __init__(self, context: Any, num_processes: int, rank_offset: int, job_dir: str | None = None) -> None:
        self.context = context
        self.num_processes = num_processes
        self.rank_offset = rank_offset
        self.job_dir = job_dir
        self.procs: list[Any] = []
        self._lock = threading.Lock()

    def kill(self, signum: int = signal.SIGTERM) -> None:
        with self._lock:
            procs = list(self.procs)
        started = [p for p in procs if p.pid is not None]
        kill_process_groups([p.pid for p in started], signum=signum, grace=KILL_GRACE_S)
        for p in started:
            p.join(timeout=0)

    def run(self, strategy: Any, function: Callable[..., Any], args: tuple, kwargs: dict) -> bytes | None:
        restore_sigterm = _raise_on_sigterm()
        readers: dict[Connection, int] = {}
        try:
            for idx in range(self.num_processes):
                reader, writer = self.context.Pipe(duplex=False)
                proc = self.context.Process(
                    target=_worker,
                    args=(idx, self.rank_offset + idx, os.getpid(), strategy, function, args, kwargs, writer, self.job_dir),
                    name=f"fabric-rank-{self.rank_offset + idx}",
                    daemon=False,  # daemonic processes may not start DataLoader workers
                )
                with self._lock:
                    self.procs.append(proc)
                proc.start()
                writer.close()
                readers[reader] = idx
            return self._supervise(readers)
        finally:
            # Whatever happened (failure, Ctrl-C, SIGTERM), nothing of the job survives.
            self.kill()
            for proc in self.procs:
                if proc.pid is not None:
                    proc.join(timeout=KILL_GRACE_S)
            for reader in readers:
                reader.close()
            restore_sigterm()

    def _supervise(self, readers: dict[Connection, int]) -> bytes | None:
        self._readers = readers
        self._by_idx = {idx: conn for conn, idx in readers.items()}
        self._sentinels = {p.sentinel: idx for idx, p in enumerate(self.procs)}
        self._results: dict[int, tuple[str, Any]] = {}
        while self._sentinels:
            self._collect(wait(list(self._sentinels) + list(self._readers)))
            self._fail_if_any()
        ok = self._results.get(0)
        return ok[1] if ok is not None and ok[0] == "ok" else None

    def _collect(self, ready: list[Any]) -> None:
        """Take in what ``wait`` reported: messages from workers, and workers that ended."""
        # Messages first: a worker's traceback arrives just before its exit.
        for obj in ready:
            if obj in self._readers:
                self._receive(obj)
        for obj in ready:
            if obj in self._sentinels:
                idx = self._sentinels.pop(obj)
                # A closed sentinel means the process is exiting; join() collects its status
                # (a non-blocking poll could still miss it for a moment).
                self.procs[idx].join()
                conn = self._by_idx[idx]
                if conn in self._readers and conn.poll(0):
                    self._receive(conn)

    def _receive(self, conn: Connection) -> None:
        idx = self._readers.pop(conn)
        try:
            self._results[idx] = conn.recv()
        except (EOFError, OSError):
            pass
        finally:
            conn.close()  # a worker sends one message at most

    def _classify(self) -> tuple[list[int], list[int]]:
        """(ranks that died without reporting an exception, ranks that raised)."""
        died, raised = [], []
        for idx, proc in enumerate(self.procs):
            message = self._results.get(idx)
            if message is not None and message[0] == "error":
                raised.append(idx)
            elif proc.exitcode not in (None, 0):
                died.append(idx)
        return died, raised

    def _fail_if_any(self) -> None:
        """Raise for the failure that most likely caused the others, if any rank failed.

        Failures seen together are usually one cause and its echoes: when a rank dies,
        its peers raise "connection closed" moments later, and that message can even
        overtake the news of the death. So a rank that died without reporting an
        exception (a signal, ``os._exit``) is blamed before ranks that raised, and if only
        exceptions are known we keep listening for ``_SETTLE_S`` seconds first. Among ranks
        that raised, the one that raised first is the cause: its peers' errors ("connection
        closed" in a collective) can only follow it, though their reports may arrive together.
        """
        died, raised = self._classify()
        deadline = time.monotonic() + _SETTLE_S
        while raised and not died and self._sentinels:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._collect(wait(list(self._sentinels) + list(self._readers), timeout=remaining))
            died, raised = self._classify()
        if died or raised:
            idx = died[0] if died else min(raised, key=self._raised_at)
            self._fail(idx, self._results.get(idx))

    def _raised_at(self, idx: int) -> float:
        message = self._results.get(idx)
        return float(message[2]) if message is not None and len(message) > 2 else float("inf")

    def _fail(self, idx: int, message: tuple[str, Any] | None) -> None:
        report = self._diagnosis()
        # Stop everyone first (the failed worker too: it may hang in its shutdown).
        self.kill()
        proc = self.procs[idx]
        proc.join(timeout=KILL_GRACE_S)
        traceback_text = message[1] if message is not None and message[0] == "error" else None
        raise RankFailedError(self.rank_offset + idx, proc.exitcode, traceback_text, diagnosis=report)

    def _diagnosis(self) -> str | None:
        """For a collective timeout: which workers did not arrive and where each one was.

        Asked before anyone is stopped, while the stuck workers can still answer.
        """
        live = {self.rank_offset + i: p.pid for i, p in enumerate(self.procs) if p.pid is not None and p.exitcode is None}
        raised = {self.rank_offset + i: m[1] for i, m in self._results.items() if m[0] == "error"}
        for rank in raised:
            live.pop(rank, None)  # it reported its error; whatever it does now is shutting down
        try:
            return diagnose(self.job_dir, live, raised)
        except Exception as err:  # a diagnosis must never stand in the way of the teardown
            return f"fabric: could not diagnose the failure ({type(err).__name__}: {err})"


def _raise_on_sigterm() -> Callable[[], None]:
    """While the job runs, turn SIGTERM into SystemExit(143) so cleanup code runs.

    Only done from the main thread and only if nobody handles SIGTERM already;
    returns a function that restores the previous state.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        return lambda: None

    launcher_pid = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != launcher_pid:
            # A worker forked before it could reset its handlers: die as SIG_DFL would.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)
