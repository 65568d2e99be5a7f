"""A small classifier trained on synthetic data; the same script runs under Horovod or under DDP.

    horovodrun -np 2 -H localhost:2 python examples/horovod_train.py --strategy horovod
    python examples/horovod_train.py --strategy ddp --devices 2

With Horovod, ``horovodrun`` starts the processes and ``fabric.launch()`` only sets each one up; with
DDP, ``fabric.launch()`` starts the other processes itself. Nothing else in the loop changes.
Horovod comes from ``make horovod`` (see scripts/build_horovod.sh).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def synthetic_blobs(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian clusters around random centres: easy to learn, so a few steps show the loss falling."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=generator) * 0.4
    labels = torch.randint(classes, (samples,), generator=generator)
    points = centres[labels] + torch.randn(samples, features, generator=generator)
    return TensorDataset(points, labels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="horovod", help="horovod (under horovodrun), ddp, auto, ...")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", default="auto", help="processes per machine for ddp; horovod: leave 'auto'")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if isinstance(args.devices, str) and args.devices.lstrip("-").isdigit():
        args.devices = int(args.devices)
    return args


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    fabric = Fabric(accelerator=args.accelerator, strategy=args.strategy, devices=args.devices)
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)

    dataset = synthetic_blobs(samples=4096, features=20, classes=4, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)

    step, micro, loss = 0, 0, torch.zeros(())
    start = time.perf_counter()
    while step < args.steps:
        for inputs, targets in loader:
            micro += 1
            stepping = micro % args.accumulate == 0
            # accumulate locally; only the micro-batch that ends the step synchronizes gradients
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = torch.nn.functional.cross_entropy(model(inputs), targets)
                fabric.backward(loss / args.accumulate)
            if not stepping:
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0 or step == 1:
                mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
                fabric.print(f"step {step:4d}  loss {mean_loss.item():.4f}")
            if step == args.steps:
                break
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        points, labels = dataset.tensors
        correct = (model(fabric.to_device(points)).argmax(dim=1).cpu() == labels).sum()
    accuracy = fabric.all_reduce(correct, reduce_op="mean").item() / len(labels)
    final = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
    fabric.print(
        f"final loss {final:.4f}  accuracy {accuracy:.3f}  strategy {args.strategy}"
        f"  world_size {fabric.world_size}  {elapsed / max(step, 1) * 1000:.1f} ms/step"
    )
    return final


if __name__ == "__main__":
    main()
