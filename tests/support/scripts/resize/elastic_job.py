"""One rank of an elastic job: the ranks of every node that is left go on after a node is lost for good.

    fabric-torch run --num-nodes 1:2 --max-restarts 1 ... elastic_job.py OUT     (or under torchrun)

Trains one epoch over a dataset of sample ids, saving model, optimizer, loader and step to
``OUT/ckpt.pt`` after every step, and loading it first when it exists (the exact-resume recipe,
with no knowledge of the number of processes). Every step a rank writes
``OUT/w{WORLD_SIZE}-a{RESTART}-rank{R}-step{S}.json`` (the ids it trained on, the step it resumed
from), then waits ``STEP_S`` so the test can stop a node mid-epoch; rank 0 writes ``OUT/saved`` (the
step) after each save.

``ELASTIC_HOLD=STEP:WORLD`` in the environment: while the job runs on fewer than WORLD ranks, each rank waits after
step STEP (up to 150 s) instead of going on, so a node that joins later finds the job mid-epoch however long it
takes to start; the agents' next round (restarting the ranks on WORLD ranks) ends the wait.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from fabric import Fabric, seed_everything

SAMPLES, BATCH, STEP_S = 64, 2, 0.4


def main() -> None:
    out = Path(sys.argv[1])
    hold = tuple(int(part) for part in os.environ["ELASTIC_HOLD"].split(":")) if os.environ.get("ELASTIC_HOLD") else None
    seed_everything(11)
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp")
    fabric.launch()
    model = fabric.setup_module(nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.2), nn.Linear(8, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(torch.arange(SAMPLES), batch_size=BATCH, shuffle=True))
    checkpoint = out / "ckpt.pt"
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if checkpoint.exists():
        fabric.load(checkpoint, state)
    resumed_at = state["step"]
    tag = f"w{fabric.world_size}-a{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-rank{fabric.global_rank}"
    for ids in loader:
        loss = model(ids.float().unsqueeze(1) / SAMPLES).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        record = {"ids": ids.tolist(), "resumed_at": resumed_at, "world_size": fabric.world_size}
        (out / f"{tag}-step{state['step']}.json").write_text(json.dumps(record))
        fabric.save(checkpoint, state)
        if fabric.global_rank == 0:
            (out / "saved").write_text(str(state["step"]))
        time.sleep(STEP_S)
        if hold is not None and state["step"] == hold[0] and fabric.world_size < hold[1]:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:  # the agent restarts this rank once the other node joined
                time.sleep(0.1)


if __name__ == "__main__":
    main()
