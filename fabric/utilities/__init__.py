"""Small helpers shared by the layers above: moving data, seeding, rank-zero output."""

from fabric.utilities.apply_func import move_data_to_device
from fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from fabric.utilities.seed import seed_everything

__all__ = ["move_data_to_device", "rank_zero_info", "rank_zero_only", "rank_zero_warn", "seed_everything"]
