"""Output that only the process of global rank 0 gives, so N processes do not print N times."""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

log = logging.getLogger("fabric")


def _rank_from_environment() -> int:
    # the launchers and external launchers (torchrun, SLURM, MPI, LSF) put the global rank here
    for name in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


rank_zero_only.rank = getattr(rank_zero_only, "rank", _rank_from_environment())


@rank_zero_only
def rank_zero_info(message: str, *args: Any, **kwargs: Any) -> None:
    log.info(message, *args, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 4) -> None:
    import warnings

    warnings.warn(message, category=category, stacklevel=stacklevel)


__all__ = ["rank_zero_info", "rank_zero_only", "rank_zero_warn"]
