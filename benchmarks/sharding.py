"""FSDP through Fabric: per-rank memory against DDP, and step time against raw ``fully_shard``, in one run.

In N processes (gloo on the CPU, one thread each) the same model (an 8-layer, 512-wide MLP with
AdamW) is set up three ways over one process group: raw ``DistributedDataParallel``, raw
``fully_shard`` on every layer and the root, and ``Fabric(strategy=FSDPStrategy(auto_wrap_policy=
{nn.Linear}))``, the same sharding. Reported:

- memory: bytes of parameters + gradients + optimizer state held by one rank after a step, FSDP / DDP
  (goal <= 1/N + 10%);
- step time: blocks of steps alternate between raw fully_shard and Fabric (the order flips every
  round); the ratio is the median over rounds of (Fabric block time / raw block time) (goal <= 1.03x).

    python benchmarks/sharding.py [--devices 2] [--rounds 20] [--steps 5] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric import Fabric
from fabric.strategies import FSDPStrategy

WIDTH = 512


def make_mlp(depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for parameters, their gradients and the optimizer state (shards only)."""

    def nbytes(tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor):
            return 0
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    total = sum(nbytes(p) + nbytes(p.grad) for p in model.parameters())
    return total + sum(nbytes(value) for state in optimizer.state.values() for value in state.values())


def run(fabric: Fabric, rounds: int, steps: int, batch: int) -> dict[str, Any] | None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    batches = [(torch.randn(batch, WIDTH, generator=generator), torch.randn(batch, WIDTH, generator=generator)) for _ in range(4)]
    loss_fn = nn.MSELoss()

    ddp = DistributedDataParallel(make_mlp())
    ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    raw = make_mlp()
    for layer in raw:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=fabric.strategy.device_mesh)
    fully_shard(raw, mesh=fabric.strategy.device_mesh)
    raw_optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    model = fabric.setup_module(make_mlp())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))

    def raw_step(x: torch.Tensor, y: torch.Tensor) -> None:
        raw_optimizer.zero_grad(set_to_none=True)
        loss_fn(raw(x), y).backward()
        raw_optimizer.step()

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        ddp_optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        ddp_optimizer.step()

    def fabric_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()

    def block(step_fn: Any, count: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for i in range(count):
            step_fn(*batches[i % len(batches)])
        dist.barrier()
        return (time.perf_counter() - start) / count

    # one step each, then measure memory before zero_grad frees the gradients
    for step_fn, (x, y) in ((ddp_step, batches[0]), (raw_step, batches[0])):
        step_fn(x, y)
    fabric_model_loss = loss_fn(model(batches[0][0]), batches[0][1])
    optimizer.zero_grad(set_to_none=True)
    fabric.backward(fabric_model_loss)
    optimizer.step()
    memory = {"ddp": local_bytes(ddp, ddp_optimizer), "raw_fsdp": local_bytes(raw, raw_optimizer), "fabric_fsdp": local_bytes(model, optimizer)}

    variants = {"raw": raw_step, "fabric": fabric_step}
    for step_fn in variants.values():
        block(step_fn, steps)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
            times[name].append(block(variants[name], steps))
    return {"memory": memory, "times": times} if fabric.global_rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}), devices=args.devices)
    result = fabric.launch(run, args.rounds, args.steps, args.batch)
    if result is None:
        return
    n = args.devices
    memory, times = result["memory"], result["times"]
    ratio = memory["fabric_fsdp"] / memory["ddp"]
    print(f"per-rank bytes (params + grads + AdamW state), {n} processes:")
    print(
        f"  DDP {memory['ddp'] / 2**20:8.2f} MiB   raw fully_shard {memory['raw_fsdp'] / 2**20:8.2f} MiB"
        f"   Fabric FSDP {memory['fabric_fsdp'] / 2**20:8.2f} MiB"
    )
    print(f"fsdp/ddp memory ratio: {ratio:.3f}   (goal <= 1/{n} + 10% = {1 / n * 1.1:.3f})")
    raw, wrapped = statistics.median(times["raw"]), statistics.median(times["fabric"])
    paired = statistics.median(f / r for f, r in zip(times["fabric"], times["raw"]))
    print(
        f"raw fully_shard step median {raw * 1e3:8.3f} ms   Fabric FSDP step median {wrapped * 1e3:8.3f} ms"
        f" ({args.rounds} rounds x {args.steps} steps, batch {args.batch})"
    )
    print(f"fsdp step ratio fabric/raw: {paired:.3f}x   (median of per-round ratios; goal <= 1.03x)")


if __name__ == "__main__":
    main()
