"""Hearing that the cluster is about to take the machine, on every rank at the same step.

Schedulers warn before they pre-empt a job: SLURM sends SIGUSR1 (``--signal``) or SIGTERM, Kubernetes
SIGTERM. ``Fabric.preempted`` asks every rank "did you get such a signal?" through one collective and
returns the same answer everywhere, so all ranks stop at the same step, save, and exit cleanly.

The policy (docs/preemption.md):

- The signal handlers are installed when the loop first reads ``preempted`` (so scripts that never
  ask keep the default behaviour: SIGTERM ends them). From then on SIGUSR1 and the first SIGTERM only
  raise the flag; so does a SIGTERM within ``SAME_WARNING_S`` of the first (the same warning twice: a
  scheduler may signal the launcher and the ranks alike, and the launcher passes it on). A later
  SIGTERM (the user or the supervisor insists) ends the process with status 143 within seconds, even
  while its main thread is blocked in an upload or a collective: a thread of its own hears each
  delivery (``SignalTap``), waits at most ``SECOND_SIGNAL_WAIT_S`` for the work left at the end (the
  loggers' last rows) and ends the process with ``os._exit``, which no thread blocked in I/O can hold up.
- One rank hearing the signal is enough: the collective tells the others.
- Under SLURM with ``auto_requeue``, global rank 0 requeues the job (``scontrol requeue``) when it
  exits after a pre-emption was agreed, i.e. after the user's checkpoint is on disk.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from fabric._core.processes import FLUSH_WAIT_S, end_process, signal_name
from fabric.supervision.rank_side import write_stderr
from fabric.supervision.signals import SignalTap

#: the warnings schedulers send before they take the machine
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: a SIGTERM this soon (seconds) after the first is the same warning again (the scheduler signalled the launcher and
#: the ranks, and the launcher passed it on within milliseconds); a later one ends the process
SAME_WARNING_S = 1.0
#: how long a process told twice waits for the work left at its end (``fabric._core.process_end``) before it ends
SECOND_SIGNAL_WAIT_S = 2.0


class PreemptionListener:
    """Records the first pre-emption signal this process receives, and ends the process on a second SIGTERM
    (installed once per process, from the main thread)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.rank = 0  # for the message of a second SIGTERM
        self._installed_in: int | None = None  # the pid that installed it (a forked copy installs its own)
        self._tap: SignalTap | None = None
        self._first_sigterm: float | None = None
        self._lock = threading.Lock()

    def install(self) -> None:
        if self._installed_in == os.getpid():
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Fabric.preempted must first be read from the main thread: Python delivers signals only there"
            )
        if self._installed_in is not None:  # a forked copy of a process that listened: its own warnings only
            self.received, self._first_sigterm, self._lock = None, None, threading.Lock()
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._handle)
        # every delivery, heard at once on a thread of its own: Python runs the handler above only when the main thread
        # gets back to Python code (never while it is blocked in C: a collective), and once for several deliveries
        self._tap = SignalTap(PREEMPTION_SIGNALS, self._delivered)
        self._installed_in = os.getpid()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if os.getpid() == self._installed_in and (self._tap is None or not self._tap.installed):
            self._delivered(signum)  # no tap here: the handler is all there is
        # a forked copy (a DataLoader worker) only keeps the flag, as before: the warning must not end it

    def _delivered(self, signum: int) -> None:
        """One delivery of a pre-emption signal, heard at once (on the tap's thread)."""
        if self.received is None:
            self.received = signum
        if signum != signal.SIGTERM:
            return
        now = time.monotonic()
        with self._lock:
            first = self._first_sigterm
            if first is None:
                self._first_sigterm = now
                return
        if now - first < SAME_WARNING_S:
            return
        write_stderr(
            f"[fabric] rank {self.rank} received {signal_name(signum)} again, {now - first:.1f} s after the first"
            f" (the pre-emption warning); ending this process now with status {128 + signum}",
            timeout=FLUSH_WAIT_S,
        )
        end_process(128 + signum, wait=SECOND_SIGNAL_WAIT_S)


_LISTENER = PreemptionListener()
_REQUEUE_REGISTERED = False


def preempted(strategy: Any) -> bool:
    """Whether any rank received a pre-emption signal; the same answer on every rank (a collective)."""
    _LISTENER.rank = int(getattr(strategy, "global_rank", 0) or 0)
    _LISTENER.install()
    agreed = bool(strategy.reduce_boolean_decision(_LISTENER.received is not None, all=False))
    if agreed:
        _requeue_at_exit_if_asked(strategy)
    return agreed


def _requeue_at_exit_if_asked(strategy: Any) -> None:
    global _REQUEUE_REGISTERED
    if _REQUEUE_REGISTERED or strategy.global_rank != 0:
        return
    # only a SLURMEnvironment carries auto_requeue; asking for the attribute keeps this module below the
    # cluster environments (an import of SLURMEnvironment would point up the layers)
    environment = getattr(strategy, "cluster_environment", None)
    if not getattr(environment, "auto_requeue", False):
        return
    _REQUEUE_REGISTERED = True
    atexit.register(requeue_slurm_job)


def slurm_job_id() -> str:
    """The id ``scontrol requeue`` takes: ``ARRAYID_TASKID`` for an array task, else the job id."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise RuntimeError("SLURM_JOB_ID is not set: this process does not run inside a SLURM job")
    return job_id


def requeue_slurm_job() -> bool:
    """Put this SLURM job back in the queue (``scontrol requeue``); says on stderr what happened."""
    try:
        job_id = slurm_job_id()
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"[fabric] pre-empted: could not requeue the SLURM job: {err}", file=sys.stderr, flush=True)
        return False
    if result.returncode != 0:
        print(f"[fabric] pre-empted: `scontrol requeue {job_id}` failed with {result.returncode}:"
              f" {(result.stderr or result.stdout).strip()}", file=sys.stderr, flush=True)
        return False
    print(f"[fabric] pre-empted: requeued SLURM job {job_id}", file=sys.stderr, flush=True)
    return True
