"""Training through HorovodStrategy under `horovodrun -np 2`: set-up, gradients, accumulation, clipping,
convergence and a checkpoint round trip.

Writes ``rank<r>.json`` into the folder given as the first argument; tests/strategies/test_horovod.py recomputes
the expected gradients with NumPy from the data recorded here.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric
from fabric.plugins.io import TorchCheckpointIO


class CountingIO(TorchCheckpointIO):
    """Counts the files this rank writes (only rank 0 should write)."""

    saves = 0

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        CountingIO.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


class Regression(Dataset):
    def __init__(self, n: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, generator=generator)
        self.y = self.x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def listed(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.detach().tolist()
    if isinstance(data, dict):
        return {str(key): listed(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [listed(value) for value in data]
    return data


def batch(rank: int, index: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(size, 3, generator=generator), torch.randn(size, 1, generator=generator)


def grads(model: torch.nn.Module) -> dict[str, Any]:
    return {name: listed(p.grad) for name, p in model.named_parameters()}


def params(model: torch.nn.Module) -> dict[str, Any]:
    return {name: listed(p) for name, p in model.named_parameters()}


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", strategy="horovod", plugins=[CountingIO()])
    fabric.launch()
    r = fabric.global_rank
    results: dict[str, Any] = {}
    mse = torch.nn.functional.mse_loss

    # set-up: every rank starts from rank 0's weights, and the (empty) optimizer state takes no step
    torch.manual_seed(100 + r)
    model = torch.nn.Linear(3, 1)
    results["initial_local"] = params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    results["after_setup"] = params(model)
    results["optimizer_state_after_setup"] = len(optimizer.state)
    results["optimizer_is_sgd"] = isinstance(optimizer, torch.optim.SGD)

    # one step: the gradient is the mean of the ranks' local gradients
    x, y = batch(r, 0)
    fabric.backward(mse(model(x), y))
    optimizer.step()
    results["step"] = {"x": listed(x), "y": listed(y), "grads": grads(model), "params": params(model)}
    optimizer.zero_grad()  # through the wrapper: Horovod's own zero_grad would recurse here
    results["zero_grad_to_none"] = all(p.grad is None for p in model.parameters())

    # gradient accumulation over 3 micro-batches, three ways
    for mode in ("last_outside", "all_inside", "no_block"):
        start = params(model)
        micro = [batch(r, 10 + i) for i in range(3)]
        record: dict[str, Any] = {"start": start, "micro": [[listed(a), listed(b)] for a, b in micro]}
        for i, (mx, my) in enumerate(micro):
            skip = mode == "all_inside" or (mode == "last_outside" and i < 2)
            with fabric.no_backward_sync(model, enabled=skip):
                fabric.backward(mse(model(mx), my) / 3)
            if i == 0:
                time.sleep(0.2)  # an all-reduce started by mistake would have landed in .grad by now
                record["grad_after_first"] = grads(model)
        optimizer.step()
        record["grads"] = grads(model)
        optimizer.zero_grad()
        results[f"accumulate_{mode}"] = record

    # clipping sees the averaged gradients, the same on every rank
    x, y = batch(r, 20)
    start = params(model)
    fabric.backward(mse(model(x), y))
    norm = fabric.clip_gradients(model, optimizer, max_norm=1e-3)
    results["clip"] = {"start": start, "x": listed(x), "y": listed(y), "norm": float(norm), "grads": grads(model)}
    optimizer.step()
    optimizer.zero_grad()

    # Horovod's own idiom, on the Fabric optimizer: synchronize, then step without a second all-reduce
    x, y = batch(r, 30)
    start = params(model)
    fabric.backward(mse(model(x), y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()
    results["idiom"] = {
        "start": start, "x": listed(x), "y": listed(y), "grads": grads(model),
        "warnings": [str(w.message) for w in caught],
    }
    optimizer.zero_grad()

    # a short training run on sharded data: it converges and the replicas stay identical
    torch.manual_seed(200 + r)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    adam = torch.optim.Adam(net.parameters(), lr=0.05)
    net, adam = fabric.setup(net, adam)
    loader = fabric.setup_dataloaders(DataLoader(Regression(), batch_size=16, shuffle=True))
    losses, seen = [], []
    for epoch in range(6):
        total = torch.zeros(())
        for bx, by, index in loader:
            loss = mse(net(bx), by)
            fabric.backward(loss)
            adam.step()
            adam.zero_grad()
            total += loss.detach()
            if epoch == 0:
                seen.extend(index.tolist())
        losses.append(float(fabric.all_reduce(total / len(loader))))
    results["train"] = {"losses": losses, "seen_epoch0": seen, "params": params(net), "batches": len(loader)}

    # checkpoint: written once (by rank 0), loaded on every rank into freshly made objects
    path = out / "checkpoint.pt"
    saved_state = {name: listed(value) for name, value in adam.state_dict()["state"][0].items()}
    fabric.save(path, {"model": net, "optimizer": adam, "step": 7})
    results["saves"] = CountingIO.saves
    results["saved_adam_state0"] = saved_state
    torch.manual_seed(300 + r)
    net2 = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    adam2 = fabric.setup_optimizers(torch.optim.Adam(net2.parameters(), lr=0.5))
    scheduler = torch.optim.lr_scheduler.StepLR(adam2, step_size=1, gamma=0.5)
    state = {"model": net2, "optimizer": adam2, "step": 0}
    remainder = fabric.load(path, state)
    results["loaded"] = {
        "params": params(net2),
        "adam_state0": {name: listed(value) for name, value in adam2.state_dict()["state"][0].items()},
        "step": state["step"],
        "remainder": sorted(remainder),
        "lr": adam2.param_groups[0]["lr"],
        "same_groups": adam2.param_groups is adam2.optimizer.param_groups,
    }
    fabric.backward(mse(net2(bx), by))
    adam2.step()
    scheduler.step()
    adam2.zero_grad()
    results["after_load_step"] = {"params": params(net2), "lr": adam2.optimizer.param_groups[0]["lr"]}
    (out / f"rank{r}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
