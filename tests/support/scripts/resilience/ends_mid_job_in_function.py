"""``ends_mid_job.py`` as a function that ``fabric.launch(fn)`` runs in new processes: `SCRIPT HOW STRATEGY`.

STRATEGY: ``ddp_spawn`` or ``ddp_fork``. The launching process is no rank: rank 1 ends mid-job in the way
named by HOW (``exit3``: ``sys.exit(3)``; ``exit0``: ``sys.exit(0)``; ``os_exit5``: ``os._exit(5)``) while
rank 0 keeps calling collectives, so its gloo error ("connection closed by peer") follows: an echo, never
the cause. Nothing catches the launcher's error, so the program ends as a user's script would.
"""

import os
import sys
import time

import torch

from fabric import Fabric


def body(fabric: Fabric, how: str) -> None:
    value = torch.ones(1)
    for step in range(3000):
        fabric.all_reduce(value)
        if fabric.global_rank == 1 and step == 10:
            if how == "exit3":
                sys.exit(3)
            if how == "exit0":
                sys.exit(0)
            if how == "os_exit5":
                os._exit(5)
        time.sleep(0.01)


if __name__ == "__main__":
    Fabric(accelerator="cpu", devices=2, strategy=sys.argv[2]).launch(body, sys.argv[1])
