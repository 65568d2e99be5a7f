"""One-process jobs of the distributed strategies on a device given on the command line: ``world1.py DEVICE JOB OUT``.

DEVICE is ``cuda`` (the GPU check: NCCL, CUDA placement) or ``cpu`` (the same job's logic in the CPU suite,
over gloo). Each job runs in its own process because it sets up a process group; it prints one line
``RESULT {json}`` with what it measured, and the test (``tests/gpu/test_device_jobs.py``) judges it.

Jobs: ``ddp``, ``fsdp`` (empty_init on the meta device materialised on the device, training against a
one-process reference, sharded save, async sharded save), ``fsdp_offload``, ``tp`` (ModelParallelStrategy,
mesh 1 x 1), ``dcp_save`` / ``dcp_load`` (the two device ends of a DCP round trip through the CPU).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fabric import Fabric
from fabric.strategies import FSDPStrategy, ModelParallelStrategy
from support.scripts.sharding.model import data, full_parameters, make_net, max_difference, parallelize, reference_run

STEPS = 3
LR = 0.05


def new_fabric(device: str, strategy: Any, precision: str | None = None) -> Fabric:
    fabric = Fabric(accelerator=device, devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def train(fabric: Fabric, model: Any, optimizer: Any, steps: int = STEPS) -> list[float]:
    xs, ys = data(steps)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.mse_loss(model(x.to(fabric.device)), y.to(fabric.device))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def on_cpu(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().float().cpu() for name, value in params.items()}


def local_device(param: torch.Tensor) -> str:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.device.type


def set_up_sharded(fabric: Fabric, seed: int = 0) -> tuple[Any, Any]:
    model = fabric.setup_module(make_net(seed))
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))


def ddp(device: str, out: Path) -> dict[str, Any]:
    fabric = new_fabric(device, "ddp")
    model = make_net()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    x, y = (t[0].to(fabric.device) for t in data(1))
    with fabric.no_backward_sync(model):  # the no-sync path runs once, its gradient thrown away after
        fabric.backward(F.mse_loss(model(x), y))
    optimizer.zero_grad()
    train(fabric, model, optimizer)
    expected, _ = reference_run(STEPS, None, lr=LR)
    total = fabric.all_reduce(torch.tensor(3.0, device=fabric.device), reduce_op="sum")
    gathered = fabric.all_gather(torch.arange(3, device=fabric.device))
    tensor = fabric.broadcast(torch.ones(2, device=fabric.device))
    fabric.save(out / "ddp.ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    trained = on_cpu(dict(model.module.named_parameters()))
    other = make_net(seed=5)
    other, other_optimizer = fabric.setup(other, torch.optim.AdamW(other.parameters(), lr=LR))
    remainder = fabric.load(out / "ddp.ckpt", {"model": other, "optimizer": other_optimizer})
    fabric.barrier()
    return {
        "backend": fabric.strategy.process_group_backend,
        "wrapped": type(model._forward_module).__name__,
        "param_device": next(model.parameters()).device.type,
        "max_diff": max_difference(trained, expected),
        "collectives": [total.item(), total.device.type, gathered.tolist(), gathered.device.type, tensor.device.type],
        "broadcast_object": fabric.broadcast({"answer": 42}),
        "decision": fabric.reduce_boolean_decision(True),
        "loaded_diff": max_difference(on_cpu(dict(other.module.named_parameters())), trained),
        "remainder": remainder,
    }


def fsdp(device: str, out: Path) -> dict[str, Any]:
    fabric = new_fabric(device, FSDPStrategy())
    with fabric.init_module(empty_init=True):
        empty = make_net()
    was_meta = all(p.is_meta for p in empty.parameters())
    empty = fabric.setup_module(empty)
    materialized = {
        "devices": sorted({local_device(p) for p in empty.parameters()}),
        "meta_left": any(p.is_meta for p in empty.parameters()),
        "finite": all(bool(torch.isfinite(p.full_tensor()).all()) for p in empty.parameters()),
    }
    model, optimizer = set_up_sharded(fabric)
    losses = train(fabric, model, optimizer)
    expected, _ = reference_run(STEPS, None, lr=LR)
    trained = on_cpu(full_parameters(model.module))
    fabric.save(out / "sharded", {"model": model, "optimizer": optimizer, "step": STEPS})
    # async: save() returns once the shards are copied off the device; changing the model after it must not
    # change what is written (the next load waits for the write first)
    fabric.save(out / "async", {"model": model, "optimizer": optimizer, "step": STEPS}, async_save=True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    changed = on_cpu(full_parameters(model.module))
    remainder = fabric.load(out / "async", {"model": model, "optimizer": optimizer})
    async_diff = max_difference(on_cpu(full_parameters(model.module)), trained)
    fresh, fresh_optimizer = set_up_sharded(fabric, seed=5)
    sync_remainder = fabric.load(out / "sharded", {"model": fresh, "optimizer": fresh_optimizer})
    return {
        "backend": fabric.strategy.process_group_backend,
        "mesh": fabric.strategy.device_mesh.device_type,
        "empty_init_was_meta": was_meta,
        "materialized": materialized,
        "param_types": sorted({type(p).__name__ for p in model.module.parameters()}),
        "local_devices": sorted({local_device(p) for p in model.module.parameters()}),
        "losses_finite": all(math.isfinite(v) for v in losses),
        "max_diff": max_difference(trained, expected),
        "async_changed": max_difference(changed, trained),
        "async_diff": async_diff,
        "async_remainder": remainder,
        "sharded_diff": max_difference(on_cpu(full_parameters(fresh.module)), trained),
        "sharded_remainder": sync_remainder,
    }


def train_save_reload(fabric: Fabric, name: str, out: Path) -> dict[str, Any]:
    """Train a sharded model, save it as ``out/name``, load it into a fresh one: what each run agrees on."""
    model, optimizer = set_up_sharded(fabric)
    train(fabric, model, optimizer)
    expected, _ = reference_run(STEPS, None, lr=LR)
    trained = on_cpu(full_parameters(model.module))
    fabric.save(out / name, {"model": model, "optimizer": optimizer})
    fresh, fresh_optimizer = set_up_sharded(fabric, seed=5)
    fabric.load(out / name, {"model": fresh, "optimizer": fresh_optimizer})
    return {
        "backend": fabric.strategy.process_group_backend,
        "local_devices": sorted({local_device(p) for p in model.module.parameters()}),
        "max_diff": max_difference(trained, expected),
        "loaded_diff": max_difference(on_cpu(full_parameters(fresh.module)), trained),
    }


def fsdp_offload(device: str, out: Path) -> dict[str, Any]:
    return train_save_reload(new_fabric(device, FSDPStrategy(cpu_offload=True)), "offload", out)


def tp(device: str, out: Path) -> dict[str, Any]:
    fabric = new_fabric(device, ModelParallelStrategy(parallelize))
    result = train_save_reload(fabric, "tp", out)
    mesh = fabric.strategy.device_mesh
    return {**result, "mesh": [mesh.device_type, list(mesh.mesh_dim_names or ()), list(mesh.shape)]}


def dcp_save(device: str, out: Path) -> dict[str, Any]:
    """Train under FSDP on DEVICE, save a folder of shards and the weights it holds (``saved.pt``, plain CPU tensors)."""
    fabric = new_fabric(device, FSDPStrategy())
    model, optimizer = set_up_sharded(fabric)
    train(fabric, model, optimizer)
    fabric.save(out / "from_device", {"model": model, "optimizer": optimizer, "step": STEPS})
    torch.save(on_cpu(full_parameters(model.module)), out / "saved.pt")
    return {"local_devices": sorted({local_device(p) for p in model.module.parameters()})}


def dcp_load(device: str, out: Path) -> dict[str, Any]:
    """Load what the CPU saved (``from_cpu*``) back into an FSDP model on DEVICE, and train on."""
    fabric = new_fabric(device, FSDPStrategy())
    saved = torch.load(out / "saved.pt", weights_only=True)
    diffs, remainders = {}, {}
    for name in sorted(p.name for p in out.iterdir() if p.name.startswith("from_cpu")):
        model, optimizer = set_up_sharded(fabric, seed=5)
        remainders[name] = fabric.load(out / name, {"model": model, "optimizer": optimizer})
        diffs[name] = max_difference(on_cpu(full_parameters(model.module)), saved)
        losses = train(fabric, model, optimizer, 1)  # the optimizer's state came back in a usable form
    return {
        "local_devices": sorted({local_device(p) for p in model.module.parameters()}),
        "diffs": diffs,
        "remainders": remainders,
        "trains_on": math.isfinite(losses[0]),
    }


JOBS = {"ddp": ddp, "fsdp": fsdp, "fsdp_offload": fsdp_offload, "tp": tp, "dcp_save": dcp_save, "dcp_load": dcp_load}


def main() -> None:
    device, job, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    result = JOBS[job](device, out)
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
