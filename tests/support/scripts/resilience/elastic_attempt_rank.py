"""One rank of one attempt of a job whose store belongs to an elastic agent (as under torchrun).

    python elastic_attempt_rank.py TIMEOUT_S

The environment is what torchrun's agent gives a worker (RANK, WORLD_SIZE, MASTER_ADDR/PORT of the
agent's store, TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT). Joins the process
group with that timeout, all-reduces, prints the sum.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch

from fabric import Fabric
from fabric.strategies.ddp import DDPStrategy

fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=float(sys.argv[1]))))
fabric.launch()
print("sum", int(fabric.all_reduce(torch.tensor(fabric.global_rank + 1), reduce_op="sum")), flush=True)
