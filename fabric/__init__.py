"""fabric: a thin, fast, dependable acceleration layer for PyTorch training loops."""

from fabric.fabric import Fabric, seed_everything

__version__ = "0.1.0"
__all__ = ["Fabric", "seed_everything"]
