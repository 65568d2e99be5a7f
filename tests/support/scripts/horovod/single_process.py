"""strategy='horovod' without horovodrun: one rank, collectives over itself, training still works."""

from __future__ import annotations

import warnings

import torch

from fabric import Fabric


def main() -> None:
    warnings.simplefilter("always")
    fabric = Fabric(accelerator="cpu", strategy="horovod", devices=2)
    fabric.launch()  # warns: 2 devices asked for, 1 process running
    assert fabric.world_size == 1 and fabric.global_rank == 0
    model, optimizer = fabric.setup(torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    for _ in range(3):
        with fabric.no_backward_sync(model):
            fabric.backward(model(torch.ones(4, 2)).sum())
        fabric.backward(model(torch.ones(4, 2)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(before, model.weight)
    assert fabric.all_gather(torch.tensor([1.0, 2.0])).shape == (1, 2)
    assert fabric.all_reduce(torch.tensor(3.0), reduce_op="sum").item() == 3.0
    assert fabric.broadcast({"a": 1}) == {"a": 1}
    fabric.barrier()
    assert fabric.reduce_boolean_decision(True)
    print("single process ok")


if __name__ == "__main__":
    main()
