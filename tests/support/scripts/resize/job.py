"""One rank of a resize test (started by tests/checkpoint/test_resize.py through ``Fabric.launch()``).

``job.py OUT save STRATEGY PROCESSES STEPS [LOADER]``: train on a dataset of sample ids for STEPS steps of
the first epoch, save model, optimizer, loader and step, and stop (as a pre-empted job would).
``job.py OUT resume STRATEGY PROCESSES TAG [LOADER]``: load that checkpoint on PROCESSES processes, finish
the epoch, and write the ids each rank used, the step it resumed from and the final parameters.

LOADER is ``plain`` (a DataLoader that setup_dataloaders gives a DistributedSampler, the default) or a
loader with a state of its own (``support.scripts.resize.loaders``): ``resizable`` takes a state saved
by another number of processes, ``fixed`` cannot. When the load fails, each rank writes the error and
whether the model, the optimizer, the loader and the step were left as they were, then fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from fabric import Fabric, seed_everything
from support.scripts.resize.loaders import ResizableShardLoader, ShardPositionLoader

BATCH = 3
SAMPLES = {"plain": 50, "resizable": 48, "fixed": 48}  # 48: what 2 ranks leave after 2 steps splits evenly over 1-4
LOADERS = {"resizable": ResizableShardLoader, "fixed": ShardPositionLoader}


def main() -> None:
    out, phase, strategy, processes = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    kind = sys.argv[6] if len(sys.argv) > 6 else "plain"
    samples = SAMPLES[kind]
    seed_everything(7)
    fabric = Fabric(accelerator="cpu", devices=processes, strategy=strategy)
    fabric.launch()
    model = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    if kind == "plain":
        loader = fabric.setup_dataloaders(DataLoader(torch.arange(samples), batch_size=BATCH, shuffle=True))
    else:  # the loader splits the data itself
        own = LOADERS[kind](torch.arange(samples), BATCH, fabric.global_rank, fabric.world_size, seed=3)
        loader = fabric.setup_dataloaders(own, use_distributed_sampler=False)
    checkpoint = out / ("ckpt" if strategy == "fsdp" else "ckpt.pt")
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    stop = int(sys.argv[5]) if phase == "save" else None
    tag = "save" if phase == "save" else sys.argv[5]
    if phase == "resume":
        before = full_parameters(model)
        try:
            fabric.load(checkpoint, state)
        except Exception as err:
            after = full_parameters(model)
            report = {
                "error": f"{type(err).__name__}: {err}",
                "model_unchanged": all(torch.equal(before[name], after[name]) for name in before),
                "optimizer_state": len(optimizer.state_dict()["state"]),
                "loader_loaded": getattr(loader.dataloader, "loaded", None),
                "step": state["step"],
            }
            (out / f"{tag}-rank{fabric.global_rank}.json").write_text(json.dumps(report))
            fabric.barrier()  # every rank has written its report before any of them ends the job
            raise
    resumed_at, used = state["step"], []
    for ids in loader:
        loss = model(ids.float().unsqueeze(1) / samples).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        used.extend(ids.tolist())
        state["step"] += 1
        if state["step"] == stop:
            fabric.save(checkpoint, state)
            break
    report = {"used": used, "resumed_at": resumed_at, "step": state["step"]}
    (out / f"{tag}-rank{fabric.global_rank}.json").write_text(json.dumps(report))
    full = full_parameters(model)
    if fabric.global_rank == 0:
        torch.save(full, out / f"{tag}-params.pt")


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone() for name, p in model.named_parameters()}


if __name__ == "__main__":
    main()
