"""Plugins a strategy is made of: precision, checkpoint IO and the cluster environment.

Names are resolved on first use: the cluster environments import only the standard library and
``fabric run`` uses them before any rank starts, so importing this package must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric._core.lazy import lazy_attributes

if TYPE_CHECKING:
    from fabric.plugins.environments import ClusterEnvironment
    from fabric.plugins.io import CheckpointIO, TorchCheckpointIO
    from fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
    from fabric.plugins.precision.bitsandbytes import BitsandbytesPrecision

_MODULES = {
    "BitsandbytesPrecision": "fabric.plugins.precision.bitsandbytes",
    "CheckpointIO": "fabric.plugins.io",
    "ClusterEnvironment": "fabric.plugins.environments",
    "DoublePrecision": "fabric.plugins.precision",
    "HalfPrecision": "fabric.plugins.precision",
    "MixedPrecision": "fabric.plugins.precision",
    "Precision": "fabric.plugins.precision",
    "TorchCheckpointIO": "fabric.plugins.io",
}

__all__ = [
    "BitsandbytesPrecision",
    "CheckpointIO",
    "ClusterEnvironment",
    "DoublePrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
]
__getattr__ = lazy_attributes(__name__, _MODULES)  # (or a submodule, e.g. fabric.plugins.collectives)
