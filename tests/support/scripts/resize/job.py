"""One rank of a resize test (started by tests/checkpoint/test_resize.py through ``Fabric.launch()``).

``job.py OUT save STRATEGY PROCESSES STEPS``: train on a dataset of sample ids for STEPS steps of the
first epoch, save model, optimizer, loader and step, and stop (as a pre-empted job would).
``job.py OUT resume STRATEGY PROCESSES TAG``: load that checkpoint on PROCESSES processes, finish the
epoch, and write the ids each rank used, the step it resumed from and the final parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from fabric import Fabric, seed_everything

SAMPLES, BATCH = 50, 3


def main() -> None:
    out, phase, strategy, processes = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    seed_everything(7)
    fabric = Fabric(accelerator="cpu", devices=processes, strategy=strategy)
    fabric.launch()
    model = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(torch.arange(SAMPLES), batch_size=BATCH, shuffle=True))
    checkpoint = out / ("ckpt" if strategy == "fsdp" else "ckpt.pt")
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    stop = int(sys.argv[5]) if phase == "save" else None
    if phase == "resume":
        fabric.load(checkpoint, state)
    resumed_at, used = state["step"], []
    for ids in loader:
        loss = model(ids.float().unsqueeze(1) / SAMPLES).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        used.extend(ids.tolist())
        state["step"] += 1
        if state["step"] == stop:
            fabric.save(checkpoint, state)
            break
    tag = "save" if phase == "save" else sys.argv[5]
    report = {"used": used, "resumed_at": resumed_at, "step": state["step"]}
    (out / f"{tag}-rank{fabric.global_rank}.json").write_text(json.dumps(report))
    full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for name, p in model.named_parameters()}
    if fabric.global_rank == 0:
        torch.save(full, out / f"{tag}-params.pt")


if __name__ == "__main__":
    main()
