"""The loop of ``raw_pytorch.py``, moved onto Fabric: regression on synthetic data.

``diff`` this file against ``raw_pytorch.py`` to see the handful of lines that change. With the same
seed, on the CPU in full precision, both print the same losses, number for number. The same script
runs on a GPU, in mixed precision, or as several processes:

    python examples/fabric_loop.py --epochs 5
    python examples/fabric_loop.py --precision bf16-mixed
    python examples/fabric_loop.py --accelerator cpu --devices 2    # two processes (DDP, gloo)
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A small training loop on Fabric.")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048, help="size of the synthetic data set")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, mps, gpu or auto")
    parser.add_argument("--devices", default="1", help="how many devices (processes on the CPU), or e.g. '0,1'")
    parser.add_argument("--strategy", default="auto", help="auto, ddp, ddp_spawn, ...")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, 64-true, ...")
    return parser.parse_args()


def make_dataset(samples: int) -> TensorDataset:
    """y = sin(x . w) + a little noise, with 16 input features."""
    x = torch.randn(samples, 16)
    w = torch.randn(16, 1) / 4
    y = torch.sin(x @ w) + 0.05 * torch.randn(samples, 1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def train(fabric: Fabric, args: argparse.Namespace) -> float:
    fabric.seed_everything(args.seed)

    loader = DataLoader(make_dataset(args.samples), batch_size=args.batch_size, shuffle=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)

    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            total, count = total + loss.item() * len(x), count + len(x)
        # every process saw its own share of the data: add up the sums of all of them
        total, count = fabric.all_reduce(torch.tensor([total, count], dtype=torch.float64), reduce_op="sum").tolist()
        epoch_loss = total / count
        fabric.print(f"epoch {epoch + 1} loss {epoch_loss:.8f}")
    fabric.print(f"final loss {epoch_loss:.8f} (exact {epoch_loss!r})")
    return epoch_loss


if __name__ == "__main__":
    args = parse_args()
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, precision=args.precision)
    fabric.launch(train, args)
