"""A 2-rank job in a loop of all_reduce; rank 1 ends mid-job in the way named by argv[1].

``exit3``: ``sys.exit(3)``; ``exit0``: ``sys.exit(0)``; ``os_exit5``: ``os._exit(5)``. Rank 0 keeps calling
collectives, so its gloo error ("connection closed by peer") follows rank 1's end: an echo, never the cause.
"""

import os
import sys
import time

import torch

from fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
how = sys.argv[1]
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
