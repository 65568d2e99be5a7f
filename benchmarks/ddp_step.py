"""Cost of a DDP training step through Fabric vs raw ``DistributedDataParallel``, in the same 2-process run.

Both variants run in the same two processes (gloo on the CPU, one thread each), on the same model shape
(a 4-layer, 512-wide MLP) and the same batches, sharing one process group. Blocks of steps alternate
between the variants (the order flips every round) so that machine noise hits both alike; the ratio
reported is the median over rounds of (Fabric block time / raw block time).

    python benchmarks/ddp_step.py [--rounds 30] [--steps 10] [--batch 64]

Goal: ratio <= 1.03 (Fabric adds at most 3% to a DDP step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric import Fabric


def make_mlp(width: int = 512, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def run(fabric: Fabric, rounds: int, steps: int, batch: int) -> dict[str, list[float]] | None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores
    torch.manual_seed(0)
    raw_model = DistributedDataParallel(make_mlp())
    raw_optimizer = torch.optim.SGD(raw_model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    module = make_mlp()
    fabric_model, fabric_optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    batches = [(torch.randn(batch, 512, generator=generator), torch.randn(batch, 512, generator=generator)) for _ in range(4)]
    loss_fn = nn.MSELoss()

    def raw_step(x: torch.Tensor, y: torch.Tensor) -> None:
        raw_optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(raw_model(x), y)
        loss.backward()
        raw_optimizer.step()

    def fabric_step(x: torch.Tensor, y: torch.Tensor) -> None:
        fabric_optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(fabric_model(x), y)
        fabric.backward(loss)
        fabric_optimizer.step()

    variants = {"raw": raw_step, "fabric": fabric_step}

    def block(step_fn) -> float:
        dist.barrier()  # both ranks start the block together
        start = time.perf_counter()
        for i in range(steps):
            step_fn(*batches[i % len(batches)])
        dist.barrier()
        return (time.perf_counter() - start) / steps

    for step_fn in variants.values():  # warm-up: allocator, DDP bucket rebuild, lazy imports
        block(step_fn)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(block(variants[name]))
    return times if fabric.global_rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    times = fabric.launch(run, args.rounds, args.steps, args.batch)
    if times is None:
        return
    raw, wrapped = statistics.median(times["raw"]), statistics.median(times["fabric"])
    # each round's two blocks ran back to back: their ratio cancels slow drifts of the machine's load
    paired = statistics.median(f / r for f, r in zip(times["fabric"], times["raw"]))
    print(f"raw DDP step     median {raw * 1e3:8.3f} ms  ({args.rounds} rounds x {args.steps} steps, batch {args.batch})")
    print(f"fabric DDP step  median {wrapped * 1e3:8.3f} ms   (ratio of medians {wrapped / raw:.3f}x)")
    print(f"ddp step ratio fabric/raw: {paired:.3f}x   (median of per-round ratios; goal <= 1.03x)")


if __name__ == "__main__":
    main()
