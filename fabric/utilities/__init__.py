"""Small helpers shared by the layers above: moving data, seeding, rank-zero output.

The names Lightning Fabric users import from ``lightning.fabric.utilities`` are here too; the heavier
ones (data, distributed, throughput) load on first use.
"""

from __future__ import annotations

from fabric._core.lazy import lazy_attributes
from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_only, rank_zero_warn
from fabric.utilities.seed import seed_everything
from fabric.utilities.warnings import disable_possible_user_warnings

_LAZY = {
    "LightningEnum": "fabric.utilities.enums",
    "AttributeDict": "fabric.utilities.data",
    "suggested_max_num_workers": "fabric.utilities.data",
    "is_shared_filesystem": "fabric.utilities.distributed",
    "Throughput": "fabric.utilities.throughput",
    "ThroughputMonitor": "fabric.utilities.throughput",
    "measure_flops": "fabric.utilities.throughput",
}
__getattr__ = lazy_attributes(__name__, _LAZY)  # (or a submodule, e.g. fabric.utilities.types)


__all__ = [
    "disable_possible_user_warnings",
    "move_data_to_device",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "seed_everything",
    *_LAZY,
]
