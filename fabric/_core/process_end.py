"""Work that must be done before this process ends, also when it ends through ``os._exit``.

Python runs ``atexit`` hooks only when a process ends normally. A process of a job often ends another
way: a multiprocessing worker started by fork or forkserver is ended with ``os._exit`` once its function
returns, and rank 0 of a popen job ends at once with ``os._exit`` when another rank failed (or on Ctrl-C).
What holds data that is not on disk yet (a logger's buffered rows, TensorBoard's queue of events)
registers a callback with :func:`at_process_end`. The callbacks run once, in the order registered: from
``atexit`` at a normal end, or from :func:`run_process_end_callbacks`, which every ``os._exit`` of a
fabric process calls first. Either way the process waits for them at most ``HARD_END_WAIT_S`` (a log upload to
a store that stopped answering must not keep a job alive), then ends.

Standard library only (``fabric run``'s plumbing imports it).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["HARD_END_WAIT_S", "at_process_end", "run_process_end_callbacks", "run_process_end_callbacks_on_sigterm"]

#: How long a process about to end waits for the callbacks, at a normal end (atexit) and before an ``os._exit``
#: (a log file on a hung network filesystem, an upload to a store that stopped answering, must not keep a job
#: from ending).
HARD_END_WAIT_S = 10.0

_callbacks: list[Callable[[], None]] = []
_lock = threading.Lock()
_atexit_registered = False
# set when the callbacks of the latest run are done (None: none has run)
_finished: threading.Event | None = None


def at_process_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once when this process ends, normally or through a fabric ``os._exit``.

    A callback already waiting to run is not added twice. A forked child inherits what its parent
    registered (and runs it on its own copies of the objects).
    """
    global _atexit_registered
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)
        if not _atexit_registered:
            atexit.register(_run_at_exit)
            _atexit_registered = True


def _run_at_exit() -> None:
    run_process_end_callbacks(timeout=HARD_END_WAIT_S)


def run_process_end_callbacks(timeout: float | None = None) -> None:
    """Run the callbacks registered since the last run, now; return when they are done.

    With nothing left to run while another thread still runs them (the main thread's ``atexit``, when
    the supervision thread is about to end the process), wait for that run instead, so that it is not cut
    short. ``timeout``: wait at most this long; the callbacks then go on in a daemon thread, which the
    caller's coming ``os._exit`` ends.
    """
    global _finished
    with _lock:
        pending = list(_callbacks)
        _callbacks.clear()
        previous = _finished
        finished = threading.Event()
        if pending:
            _finished = finished
    if not pending:
        if previous is not None:
            previous.wait(timeout)
        return

    def run_all() -> None:
        try:
            for callback in pending:
                try:
                    callback()
                except Exception as err:  # one callback's failure must not cost the others their turn
                    name = getattr(callback, "__qualname__", repr(callback))
                    print(f"[fabric] {name} failed as the process ended: {err!r}", file=sys.stderr, flush=True)
        finally:
            finished.set()

    if timeout is None:
        run_all()
        return
    try:
        threading.Thread(target=run_all, name="fabric-process-end", daemon=True).start()
    except RuntimeError:  # no new thread this late in the interpreter's end: run them here, unbounded
        run_all()
        return
    if not finished.wait(timeout):
        names = ", ".join(getattr(callback, "__qualname__", repr(callback)) for callback in pending)
        print(
            f"[fabric] the work left as the process ended ({names}) did not finish within {timeout:g} s; ending without it",
            file=sys.stderr, flush=True,
        )  # fmt: skip


def run_process_end_callbacks_on_sigterm() -> None:
    """Let SIGTERM run the callbacks before it ends this process (with the status SIGTERM gives, as before).

    A rank started by a launcher process (``fabric run``, torchrun) is stopped with SIGTERM when another
    rank failed, and SIGKILLed after a short grace: without this, what it logged since its last write is
    lost. Only from the main thread, and only where SIGTERM has its default action (a handler of the
    user's, or the pre-emption listener installed later, takes precedence). A forked copy of this process
    (a DataLoader worker) that inherits the handler ends at once, without running them.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return
    owner = os.getpid()

    def end(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if os.getpid() == owner:
            run_process_end_callbacks(timeout=HARD_END_WAIT_S)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, end)


def _after_fork_in_child() -> None:
    """A forked child gets a lock of its own, and no run of its parent's to wait for."""
    global _lock, _finished
    _lock = threading.Lock()
    _finished = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
