"""Minimal stand-ins for a cluster environment and a strategy, so the launcher tests
need nothing of Fabric but the launchers themselves."""

from __future__ import annotations

import os


class StandInEnvironment:
    """Behaves like LightningEnvironment for the members the launchers use."""

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" not in os.environ:
            from fabric._core.env import find_free_port  # torch-free, like the launchers

            os.environ["MASTER_PORT"] = str(find_free_port())
        return int(os.environ["MASTER_PORT"])

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", "0"))

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def global_rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))


class StandInStrategy:
    """What MultiprocessingLauncher needs from a strategy; setup_worker sets rank vars."""

    def __init__(self, num_processes: int, num_nodes: int = 1) -> None:
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.cluster_environment = StandInEnvironment()

    def setup_worker(self, process_idx: int) -> None:
        os.environ["LOCAL_RANK"] = str(process_idx)
        os.environ["RANK"] = str(process_idx)
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        os.environ["WORKER_SETUP_IDX"] = str(process_idx)


def use_bare_fabric_package() -> None:
    """Import ``fabric.strategies.launchers`` without running ``fabric/__init__``.

    The launchers need only the standard library; ``fabric/__init__`` imports torch,
    which would make every rank of every test job start a second slower. Registering
    bare package objects for ``fabric`` and ``fabric.strategies`` skips their
    ``__init__`` while the launcher modules themselves are imported for real.
    """
    import sys
    import types
    from pathlib import Path

    root = Path(__file__).resolve().parents[4] / "fabric"
    for name, path in (("fabric", root), ("fabric.strategies", root / "strategies")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
