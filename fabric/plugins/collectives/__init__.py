"""Collectives as objects (Lightning Fabric's ``plugins.collectives``): a group of ranks and its operations.

For programs that arrange their own groups beside the strategy's, e.g. one rank that plays an
environment and several that train: ``TorchCollective().setup(backend="gloo")`` joins the default group,
``create_group(ranks=[0, 1])`` gives the object a group of its own, and its methods run on that group.
"""

from fabric.plugins.collectives.collective import Collective
from fabric.plugins.collectives.single_device import SingleDeviceCollective
from fabric.plugins.collectives.torch_collective import TorchCollective

__all__ = ["Collective", "SingleDeviceCollective", "TorchCollective"]
