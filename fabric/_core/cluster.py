"""Facts about the launcher or scheduler a process runs under, read from the environment.

The cluster environments (``fabric.plugins.environments``) build on these, and so do the pieces that
need them before or without an environment object: rank-zero output at import time
(``utilities/rank_zero``), the launchers' failure reports. One copy of each rule, standard library only.
"""

from __future__ import annotations

import os

__all__ = [
    "GLOBAL_RANK_VARIABLES",
    "HOROVOD_RANK",
    "LSF_RANK",
    "OPEN_MPI_RANK",
    "PMI_RANK",
    "SLURM_RANK",
    "TORCHRUN_RANK",
    "in_slurm_batch_job",
    "rank_from_environment",
]

#: Where each launcher puts the global rank.
TORCHRUN_RANK = "RANK"  # torchrun, fabric run, Kubeflow
SLURM_RANK = "SLURM_PROCID"
LSF_RANK = "JSM_NAMESPACE_RANK"
OPEN_MPI_RANK = "OMPI_COMM_WORLD_RANK"
PMI_RANK = "PMI_RANK"  # MPICH and other PMI launchers
HOROVOD_RANK = "HOROVOD_RANK"
GLOBAL_RANK_VARIABLES = (TORCHRUN_RANK, SLURM_RANK, LSF_RANK, OPEN_MPI_RANK, PMI_RANK, HOROVOD_RANK)

# job names of interactive allocations (salloc shells), where the user starts processes themselves
_INTERACTIVE_SLURM_JOB_NAMES = ("bash", "interactive")


def rank_from_environment() -> int:
    """The global rank a launcher exported to this process, 0 when none did.

    For rank-zero-only output at import time, before any strategy exists: it never raises and never
    talks to a launcher (no mpi4py), it only reads the variables the launchers set.
    """
    for name in GLOBAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def in_slurm_batch_job() -> bool:
    """Whether Slurm started this process as a task of a batch job (``srun``/``sbatch``, not an ``salloc`` shell)."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_SLURM_JOB_NAMES
