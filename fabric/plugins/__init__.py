"""Plugins a strategy is made of: precision, checkpoint IO and the cluster environment."""

from fabric.plugins.environments import ClusterEnvironment
from fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = [
    "CheckpointIO",
    "ClusterEnvironment",
    "DoublePrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
]
