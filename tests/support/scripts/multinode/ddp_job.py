"""One rank of a small multi-node job: collectives, then a few DDP (or FSDP) steps; writes what it saw to JSON.

Started by the tests under `fabric run`, torchrun, a simulated SLURM, horovodrun or by hand on two
"nodes". Takes no Fabric options itself: the launcher's environment (FABRIC_*, torchrun's or SLURM's
variables) decides the shape of the job. Usage: ddp_job.py OUT_DIR [--fail-rank R] [--strategy S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "GROUP_RANK", "FABRIC_DEVICES", "FABRIC_NUM_NODES", "FABRIC_ACCELERATOR", "FABRIC_STRATEGY",
        "OMP_NUM_THREADS", "SLURM_PROCID")


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return sock.getsockname()[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--strategy", default="auto", help="as in the code; `fabric run --strategy` sets it otherwise")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", strategy=args.strategy)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"pid{rank}").write_text(str(os.getpid()))

    total = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    gathered = fabric.all_gather(torch.tensor([rank]))
    token = fabric.broadcast(f"from-rank-0-pid-{os.getpid()}" if rank == 0 else None, src=0)
    if rank == args.fail_rank:
        raise RuntimeError(f"rank {rank} fails on purpose")

    fabric.seed_everything(1234 + rank)  # different initial weights per rank: DDP must sync them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4))
    seen = 0
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        seen += len(x)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # sharded: gathered
    flat = torch.cat([p.detach().reshape(-1) for p in whole])
    record = {
        "rank": rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": world,
        "sum": total.item(),
        "gathered": gathered.reshape(-1).tolist(),
        "broadcast": token,
        "samples_seen": seen,
        "params_sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "params": flat.tolist(),
        "local_address": _address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")),
        "strategy": type(fabric.strategy).__name__,
        "environment": type(getattr(fabric.strategy, "cluster_environment", None)).__name__,
        "env": {name: os.environ.get(name) for name in _ENV},
        "pid": os.getpid(),
        "argv": sys.argv[1:],
    }
    fabric.barrier()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
