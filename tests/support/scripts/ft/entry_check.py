"""The ``ddp_ft`` checkpoint entry goes through the checked load walk: one replica group alone, a lighthouse in this process.

A checkpoint saved with one set-up dataloader (its positions table has one loader) is loaded after a second loader was
set up: refused as a mismatch before anything changes (weights, optimizer state, the committed step count). A load
without state changes nothing and returns the entry with the rest; a checkpoint that fits restores the step count.
Prints one JSON line with what it saw. Argument: a folder for the checkpoints.
"""

import copy
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchft.coordination import LighthouseServer

from fabric import Fabric
from fabric.strategies.fault_tolerant import FaultTolerantStrategy

out = Path(sys.argv[1])
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse.address().replace(os.uname().nodename, "127.0.0.1"),
                  FABRIC_REPLICA_GROUP="0", FABRIC_NUM_REPLICA_GROUPS="1")
fabric = Fabric(accelerator="cpu", devices=1, strategy=FaultTolerantStrategy())
fabric.launch()
fabric.seed_everything(5)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = fabric.setup(model, optimizer)
first = fabric.setup_dataloaders(DataLoader(torch.randn(64, 4), batch_size=4))


def train(loader, steps):
    batches = iter(loader)
    for _ in range(steps):
        optimizer.zero_grad()
        fabric.backward(model(next(batches)).sum())
        optimizer.step()


train(first, 3)
fabric.save(out / "one_loader.ckpt", {"model": model, "optimizer": optimizer, "loader": first})
second = fabric.setup_dataloaders(DataLoader(torch.randn(64, 4), batch_size=4))
train(first, 2)
strategy = fabric.strategy
before = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), strategy.committed_steps)
checks = {}
try:
    fabric.load(out / "one_loader.ckpt", {"model": model, "optimizer": optimizer, "loader": first})
    checks["error"] = None
except Exception as err:
    checks["error"], checks["message"] = type(err).__name__, str(err)
checks["model_unchanged"] = all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
checks["optimizer_unchanged"] = all(
    torch.equal(state["momentum_buffer"], before[1]["state"][index]["momentum_buffer"])
    for index, state in optimizer.state_dict()["state"].items()
)
checks["step_unchanged"] = strategy.committed_steps == before[2]

position = first.data_position()
returned = fabric.load(out / "one_loader.ckpt")
checks["plain_load_left_step"] = strategy.committed_steps == before[2]
checks["plain_load_left_loader"] = first.data_position() == position
checks["plain_load_returned_entry"] = "ddp_ft" in returned

fabric.save(out / "two_loaders.ckpt", {"model": model, "optimizer": optimizer, "a": first, "b": second})
checks["saved_step"] = strategy.committed_steps
train(first, 2)
fabric.load(out / "two_loaders.ckpt", {"model": model, "optimizer": optimizer, "a": first, "b": second})
checks["resumed_step"] = strategy.committed_steps
print(json.dumps(checks), flush=True)
fabric.strategy.teardown()
lighthouse.shutdown()
