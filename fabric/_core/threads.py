"""How many threads a rank's intra-op pool gets: the usable cores shared among the processes of a node.

N CPU ranks that each use every core oversubscribe the machine (on 2 cores, 2 ranks x 2 threads train
about a third slower than 2 x 1). One rule for every way ranks start (``fabric run``, ``fabric.launch()``
with popen or spawn, torchrun/srun/mpirun): an ``OMP_NUM_THREADS`` the user set is left alone; otherwise
it becomes usable cores // processes on this node, at least 1. Standard library only: ``fabric run``
applies it before any rank imports torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["THREADS_VARIABLE", "share_cores", "usable_cores"]

THREADS_VARIABLE = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a scheduler may have narrowed)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def share_cores(local_processes: int, environ: MutableMapping[str, str] | None = None) -> int | None:
    """Set ``OMP_NUM_THREADS`` in ``environ`` (default: this process's) to this rank's share of the cores.

    Returns the thread count it set, or None when the user had set the variable (then nothing changes).
    """
    env = os.environ if environ is None else environ
    if THREADS_VARIABLE in env:
        return None
    threads = max(1, usable_cores() // max(1, local_processes))
    env[THREADS_VARIABLE] = str(threads)
    return threads
