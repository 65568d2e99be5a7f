"""A 2-rank DDP run that checkpoints every few steps and resumes from its latest checkpoint when started again.

    python keep_going_job.py OUTDIR [--die-rank R --die-at S] [--watch-preemption --pace SECONDS] [--strategy fsdp]
                             [--fixed-buckets]

Started by the tests under ``fabric run``, torchrun or a simulated ``srun`` (the launcher's
environment decides the ranks). What it does is docs/resume.md's recipe with latest-checkpoint
discovery:

- at start, rank 0 finds the newest ``OUTDIR/checkpoints/step-NNNNN.ckpt`` and every rank loads it;
- a checkpoint is saved every ``SAVE_EVERY`` steps;
- ``--die-rank R --die-at S``: in the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), rank R
  kills itself with SIGKILL before step S, mid-epoch;
- ``--watch-preemption``: after every step the loop reads ``fabric.preempted``; when it is True the
  ranks save, write ``preempted-rank{r}.json`` and exit 0;
- ``--fixed-buckets``: DDP keeps its first gradient buckets (``find_unused_parameters=True`` turns
  off the rebuild after the first step). With more than two ranks, a resumed run is bit-exact only
  so: the rebuild changes where the reduction splits the gradients, so the first step after a resume
  (still on the first buckets) sums them in another order than the uninterrupted run did.

Each rank writes ``progress-rank{r}`` (steps done) while it runs, and ``final-rank{r}.pt`` (parameters,
the steps this attempt trained, the attempt number) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric
from fabric.strategies import DDPStrategy

EPOCHS = 2
SAVE_EVERY = 3


class NoisyData(Dataset):
    """Sample i is (i, features of i plus fresh noise drawn from torch's generator)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return index, torch.linspace(-1, 1, 4) * (index / 64) + 0.01 * torch.randn(4)


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint: names are zero-padded steps, so they sort in step order.

    An interrupted save leaves only a hidden ``.fabric-tmp-*`` file, which the pattern does not match.
    """
    found = sorted(folder.glob("step-*.ckpt"))
    return found[-1] if found else None


def _local(value: torch.Tensor) -> torch.Tensor:
    to_local = getattr(value, "to_local", None)  # a DTensor under fsdp
    return to_local() if to_local is not None else value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--watch-preemption", action="store_true")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"],
                        help="fsdp: parameters are sharded and checkpoints are folders of shards")
    parser.add_argument("--fixed-buckets", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    strategy = DDPStrategy(find_unused_parameters=True) if args.fixed_buckets else args.strategy
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    fabric.launch()
    rank = fabric.global_rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = args.outdir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    (args.outdir / f"pid-attempt{attempt}-rank{rank}").write_text(str(os.getpid()))

    fabric.seed_everything(1234, verbose=False)
    torch.manual_seed(1234 + 1000 * rank)  # ranks draw different noise and dropout masks
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(NoisyData(), batch_size=4, shuffle=True))

    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "epoch": 0}
    # rank 0 decides which file (all ranks must load the same one, even on a folder that changes)
    checkpoint = fabric.broadcast(latest_checkpoint(folder) if rank == 0 else None, src=0)
    if checkpoint is not None:
        fabric.load(checkpoint, state)
    resumed_from = state["step"]

    step, trained = state["step"], []
    for epoch in range(state["epoch"], EPOCHS):
        for _indices, x in loader:
            if attempt == 0 and rank == args.die_rank and step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            trained.append(step)
            (args.outdir / f"progress-rank{rank}").write_text(str(step))
            state.update(step=step, epoch=epoch)
            if step % SAVE_EVERY == 0:
                fabric.save(folder / f"step-{step:05d}.ckpt", state)
            if args.pace:
                time.sleep(args.pace)
            if args.watch_preemption and fabric.preempted:
                fabric.save(folder / f"step-{step:05d}.ckpt", state)
                record = {"step": step, "attempt": attempt, "resumed_from": resumed_from}
                (args.outdir / f"preempted-rank{rank}.json").write_text(json.dumps(record))
                return
    # this rank's part: a sharded parameter's local shard, which two runs must agree on bit for bit
    params = {name: _local(value).detach().clone() for name, value in model.state_dict().items()}
    torch.save({"params": params, "trained": trained, "attempt": attempt, "resumed_from": resumed_from},
               args.outdir / f"final-rank{rank}.pt")


if __name__ == "__main__":
    main()
