"""Output that only the process of global rank 0 gives, so N processes do not print N times.

The names match ``lightning.fabric.utilities.rank_zero``. ``rank_zero_only`` (and its ``rank``) is the one
object of lightning-utilities, so setting the rank once serves both libraries; the messages go to the
``"fabric"`` logger and Python's warnings.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_utilities.core.rank_zero import WarningCache as _UtilitiesWarningCache
from lightning_utilities.core.rank_zero import rank_prefixed_message, rank_zero_only

from fabric._core.cluster import rank_from_environment

log = logging.getLogger("fabric")

# the launchers and external launchers (torchrun, SLURM, MPI, LSF, Horovod) exported the global rank;
# _core.cluster knows where
def set_rank_zero_rank(rank: int) -> None:
    """Tell the rank-zero helpers which global rank this process has."""
    rank_zero_only.rank = rank  # type: ignore[attr-defined]  # lightning-utilities reads it but does not declare it


set_rank_zero_rank(getattr(rank_zero_only, "rank", rank_from_environment()))


class LightningDeprecationWarning(DeprecationWarning):
    """The category of ``rank_zero_deprecation`` (Lightning's name, so filters written for it still match)."""


# shown by default, as Lightning shows it (Python hides a DeprecationWarning raised outside ``__main__``);
# a filter the user sets later still wins
warnings.simplefilter("default", category=LightningDeprecationWarning)


@rank_zero_only
def rank_zero_debug(message: Any, *args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    log.debug(message, *args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_info(message: Any, *args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    log.info(message, *args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, category: type[Warning] = UserWarning, stacklevel: int = 4, **kwargs: Any) -> None:
    warnings.warn(message, category=category, stacklevel=stacklevel, **kwargs)


def rank_zero_deprecation(message: str | Warning, stacklevel: int = 5, **kwargs: Any) -> None:
    kwargs.setdefault("category", LightningDeprecationWarning)
    rank_zero_warn(message, stacklevel=stacklevel, **kwargs)


class WarningCache(_UtilitiesWarningCache):
    """Each distinct message once (on rank 0), through this module's warn/info functions."""

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_warn(message, stacklevel=stacklevel, **kwargs)

    def deprecation(self, message: str, stacklevel: int = 6, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_deprecation(message, stacklevel=stacklevel, **kwargs)

    def info(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_info(message, stacklevel=stacklevel, **kwargs)


__all__ = [
    "LightningDeprecationWarning",
    "WarningCache",
    "rank_prefixed_message",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "set_rank_zero_rank",
]
