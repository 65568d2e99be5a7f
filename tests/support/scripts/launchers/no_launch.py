"""A Lightning-style script that never calls ``fabric.launch()``: ``python no_launch.py OUTDIR DEVICES NUM_NODES``.

Its processes come from an external launcher (torchrun, ``fabric run``, srun, Kubeflow). Each rank
records its ranks as seen straight after ``Fabric(...)`` and what the collectives gave.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from fabric import Fabric


def main() -> None:
    outdir, devices, num_nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=num_nodes)
    before = [fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank]
    torch.manual_seed(fabric.global_rank)  # different weights per rank: set-up must hand out rank 0's
    model = fabric.setup(torch.nn.Linear(3, 1))
    weights = fabric.all_gather(model.weight.detach().reshape(-1))
    total = fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum")
    report = {
        "before_launch": before,
        "after": [fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank],
        "total": total.item(),
        "same_weights": bool(torch.equal(weights[0], weights[-1])),
        "environment": type(fabric.strategy.cluster_environment).__name__,
    }
    if os.environ.get("CALL_LAUNCH_TOO") == "1":
        fabric.launch()  # allowed afterwards too: nothing is left to start
        report["launch_again_total"] = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
    with open(os.path.join(outdir, f"rank{fabric.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
