"""Hearing that the cluster is about to take the machine, on every rank at the same step.

Schedulers warn before they pre-empt a job: SLURM sends SIGUSR1 (``--signal``) or SIGTERM, Kubernetes
SIGTERM. ``Fabric.preempted`` asks every rank "did you get such a signal?" through one collective and
returns the same answer everywhere, so all ranks stop at the same step, save, and exit cleanly.

The policy (docs/preemption.md):

- The signal handlers are installed when the loop first reads ``preempted`` (so scripts that never
  ask keep the default behaviour: SIGTERM ends them). From then on SIGTERM and SIGUSR1 only raise the
  flag (repeats too: a scheduler may signal the launcher and the ranks alike, and the launcher passes
  it on). A rank that must go regardless is ended with SIGKILL, as every supervisor does after its
  grace period.
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
from typing import Any

#: the warnings schedulers send before they take the machine
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionListener:
    """Records the first pre-emption signal this process receives (installed once, from the main thread)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Fabric.preempted must first be read from the main thread: Python delivers signals only there"
            )
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum


_LISTENER = PreemptionListener()
_REQUEUE_REGISTERED = False


def preempted(strategy: Any) -> bool:
    """Whether any rank received a pre-emption signal; the same answer on every rank (a collective)."""
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
