"""A 2-process DDP training run that can be stopped mid-epoch and resumed in new processes.

    python resume_job.py OUTDIR full            # train 2 epochs without interruption
    python resume_job.py OUTDIR stop --at K     # train K steps, save OUTDIR/ckpt.pt, exit
    python resume_job.py OUTDIR resume          # new processes: load OUTDIR/ckpt.pt, finish the run

``--checkpoint PATH_OR_URL`` saves and loads the checkpoint there instead of OUTDIR/ckpt.pt (a bucket:
``s3://bucket/run/ckpt.pt``).

Randomness everywhere a real loop has it: a shuffled distributed sampler, dropout, noise added to
each sample by the dataset, and Python ``random`` / NumPy draws in the loop; each rank's generators
are seeded differently. Each rank writes ``{mode}-rank{r}.pt``: its final parameters and the sample
indices it trained on, in order.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric

EPOCHS = 2


class NoisyData(Dataset):
    """Sample i is (i, features of i plus fresh noise): the noise draws from torch's generator."""

    def __init__(self, n: int = 64) -> None:
        self.features = torch.linspace(-1, 1, n * 4).reshape(n, 4)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int):
        return index, self.features[index] + 0.01 * torch.randn(4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("mode", choices=["full", "stop", "resume"])
    parser.add_argument("--at", type=int, default=11)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy=args.strategy, devices=2)
    fabric.launch()
    outdir = Path(args.outdir)
    train(fabric, outdir, args.mode, args.at, args.checkpoint or outdir / "ckpt.pt")


def train(fabric: Fabric, outdir: Path, mode: str, stop_at: int, checkpoint: str | Path) -> None:
    fabric.seed_everything(1234, verbose=False)
    torch.manual_seed(1234 + 1000 * fabric.global_rank)  # ranks draw different random numbers
    random.seed(99 + fabric.global_rank)
    np.random.seed(7 + fabric.global_rank)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(NoisyData(), batch_size=4, shuffle=True))

    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "epoch": 0}
    if mode == "resume":
        fabric.load(checkpoint, state)
    seen: list[int] = []
    step = state["step"]
    for epoch in range(state["epoch"], EPOCHS):
        for indices, x in loader:
            scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
            loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean() * scale
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            seen.extend(indices.tolist())
            if mode == "stop" and step == stop_at:
                state.update(step=step, epoch=epoch)
                fabric.save(checkpoint, state)
                _report(fabric, outdir, mode, model, seen)
                return
    _report(fabric, outdir, mode, model, seen)


def _report(fabric: Fabric, outdir: Path, mode: str, model: nn.Module, seen: list[int]) -> None:
    params = {name: value.detach().clone() for name, value in model.state_dict().items()}
    torch.save({"params": params, "seen": seen}, outdir / f"{mode}-rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    sys.exit(main())
