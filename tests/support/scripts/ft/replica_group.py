"""One replica group of a fault-tolerant (``ddp_ft``) job: trains until both groups committed ``--steps`` together.

Each step appends one line to ``OUT/group{G}_attempt{A}.jsonl``: the committed step count after the step, the
quorum's size and the sample indices this rank read. With ``--die-group G --die-at N``, group G SIGKILLs
itself on its first attempt after the forward of the step that would commit step N. At the end each group
writes its weights and optimizer state to ``OUT/group{G}_final.pt``. ``--save-at K ...`` saves a checkpoint
after each committed step K; ``--resume FILE`` loads one before the first step.

The job ends when a step committed with every group taking part and at least ``--steps`` committed: both
groups see that same step (one quorum), so both stop after it with the same weights.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric


class Indexed(Dataset):
    """Sample i is (a fixed random vector, i): the index says which sample a rank read."""

    def __init__(self, size: int) -> None:
        self.inputs = torch.randn(size, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], index


parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--die-group", type=int, default=-1)
parser.add_argument("--die-at", type=int, default=12)
parser.add_argument("--step-time", type=float, default=0.05)
parser.add_argument("--time-limit", type=float, default=150.0)
parser.add_argument("--save-at", type=int, nargs="*", default=[], help="save OUT/group{G}_step{K}.ckpt after committed step K")
parser.add_argument("--resume", type=Path, default=None, help="a checkpoint to load before training")
args = parser.parse_args()

fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("FT_DEVICES", "1")), strategy="ddp_ft")
fabric.launch()
fabric.seed_everything(7)
strategy = fabric.strategy
group, groups = strategy.replica_group, strategy.num_replica_groups
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(DataLoader(Indexed(4096), batch_size=4, shuffle=True))

state = {"model": model, "optimizer": optimizer, "loader": loader}
if args.resume is not None:
    fabric.load(args.resume, state)
log = open(args.out / f"group{group}_rank{fabric.global_rank}_attempt{attempt}.jsonl", "a")  # noqa: SIM115 (a line per step until the end)
deadline = time.monotonic() + args.time_limit
done = False
epoch = 0
while not done:
    for inputs, indices in loader:
        optimizer.zero_grad()
        loss = model(inputs).pow(2).mean()
        if group == args.die_group and attempt == 0 and strategy.committed_steps + 1 == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        fabric.backward(loss)
        optimizer.step()
        committed, participants = strategy.committed_steps, strategy.participants
        if committed in args.save_at:
            fabric.save(args.out / f"group{group}_step{committed}.ckpt", state)
        log.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "attempt": attempt, "committed": committed, "participants": participants, "epoch": epoch, "indices": indices.tolist()}) + "\n")
        log.flush()
        if committed >= args.steps and participants == groups:
            done = True
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"group {group}: no step with all {groups} groups after {args.steps} steps within {args.time_limit} s")
        time.sleep(args.step_time)
    epoch += 1

if fabric.global_rank == 0:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, args.out / f"group{group}_final.pt")
print(f"group {group} done at committed step {strategy.committed_steps}", flush=True)
