"""``fabric.setup(torch.compile(model))`` under FSDP: ``python compiled_fsdp.py OUTDIR`` (Fabric re-runs it for rank 1)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from fabric import Fabric


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = fabric.setup(torch.compile(plain, backend="eager"))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for _ in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(fabric.global_rank))  # the same batch each step
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    try:
        fabric.setup(plain)
        set_up_again = "accepted"
    except ValueError as error:
        set_up_again = str(error)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        context = fabric.sharded_model()  # deprecated; FSDP2 shards at setup, so nothing to enter
    report = {
        "outer": type(model._forward_module).__name__,
        "inner": type(model._forward_module._orig_mod).__name__,
        "keys": sorted(model.state_dict()),
        "losses": losses,
        "set_up_again": set_up_again,
        "sharded_model": [type(context).__name__, *(type(w.message).__name__ for w in seen)],
    }
    (Path(sys.argv[1]) / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
