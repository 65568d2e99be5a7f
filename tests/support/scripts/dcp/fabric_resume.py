"""One rank of ``fabric.save``/``fabric.load`` under ``strategy="fsdp"``, started by torchrun.

Trains 3 steps into an epoch with a shuffling set-up loader, saves model, optimizer, loader and step
asynchronously (a folder of shards), trains 2 more steps: reference A. Then fresh objects load the
folder and train the same 2 steps: they must reach A exactly (the loader resumes mid-epoch with
every rank's random state). Writes ``OUT/rank{R}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import FSDPStrategy


def objects(fabric: Fabric, seed: int):
    torch.manual_seed(seed)
    model = fabric.setup_module(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    numbers = torch.Generator().manual_seed(0)  # the same data for both sets of objects
    data = TensorDataset(torch.randn(64, 4, generator=numbers), torch.randn(64, 1, generator=numbers))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    return model, optimizer, loader


def steps(fabric: Fabric, model, optimizer, iterator, count: int) -> None:
    for _ in range(count):
        x, y = next(iterator)
        fabric.backward((model(x) - y).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))


def main() -> None:
    out = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    fabric.seed_everything(7)
    model, optimizer, loader = objects(fabric, seed=1)
    iterator = iter(loader)
    steps(fabric, model, optimizer, iterator, 3)
    fabric.save(out / "ckpt", {"model": model, "optimizer": optimizer, "loader": loader, "step": 3}, async_save=True)
    steps(fabric, model, optimizer, iterator, 2)
    reference = full(model)

    fabric.seed_everything(7)  # the same run configuration (the sampler's seed follows it) ...
    model2, optimizer2, loader2 = objects(fabric, seed=2)  # ... other weights ...
    torch.manual_seed(1000 + fabric.global_rank)  # ... and other random state: the load restores both
    state = {"model": model2, "optimizer": optimizer2, "loader": loader2, "step": 0}
    fabric.load(out / "ckpt", state)
    steps(fabric, model2, optimizer2, iter(loader2), 2)
    resumed = full(model2)
    torch.save({"reference": reference, "resumed": resumed, "step": state["step"]}, out / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
