"""fabric: a thin, fast, dependable acceleration layer for PyTorch training loops.

``Fabric`` and ``seed_everything`` are resolved on first use, so ``fabric run`` (and anything else
that only needs a submodule) starts ranks without first paying for ``import torch``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fabric._core.lazy import lazy_attributes

__version__ = "0.1.0"
__all__ = ["Fabric", "seed_everything"]

if TYPE_CHECKING:
    from fabric.fabric import Fabric, seed_everything

# Like Lightning Fabric: fabric's INFO records (e.g. "Seed set to 42") are shown by default, on stderr,
# unless the application configured logging itself before importing fabric.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False


__getattr__ = lazy_attributes(__name__, dict.fromkeys(__all__, "fabric.fabric"))  # (or a submodule, e.g. fabric.loggers)
