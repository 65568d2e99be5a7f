"""A DDP job that holds still, its process group joined, while a test reads the sockets it listens on.

Usage: hold_job.py OUT_DIR [--strategy ddp|ddp_spawn] [--devices N]
(`fabric run` sets the devices and nodes through its variables; then leave both out.)
Every rank joins the process group, runs an all_reduce and a barrier of a second gloo group (as a
background checkpoint save makes one), writes OUT_DIR/rank{R}.json ({"pid", "master_port", "ifname"}), then waits
for OUT_DIR/go (at most 60 s) and ends with a last barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fabric import Fabric


def hold(fabric: Fabric, out: str) -> None:
    folder = Path(out)
    total = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum")
    assert total.item() == fabric.world_size
    dist.barrier(group=dist.new_group(backend="gloo"))
    record = {"pid": os.getpid(), "master_port": int(os.environ["MASTER_PORT"]),
              "ifname": {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}
    (folder / f"rank{fabric.global_rank}.json.tmp").write_text(json.dumps(record))
    os.replace(folder / f"rank{fabric.global_rank}.json.tmp", folder / f"rank{fabric.global_rank}.json")
    deadline = time.monotonic() + 60
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    fabric.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--devices", type=int, default=None)
    args = parser.parse_args()
    options = {name: value for name, value in (("strategy", args.strategy), ("devices", args.devices)) if value is not None}
    fabric = Fabric(accelerator="cpu", **options)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if fabric.strategy.start_method == "popen" or fabric.strategy.launched_externally:
        fabric.launch()
        hold(fabric, args.out)
    else:
        fabric.launch(hold, args.out)


if __name__ == "__main__":
    main()
