"""A small training loop in plain PyTorch: regression on synthetic data.

Its twin, ``fabric_loop.py``, is the same loop moved onto Fabric; ``diff`` the two files to see the
handful of lines that change. With the same seed, on the CPU in full precision, both print the same
losses, number for number.

    python examples/raw_pytorch.py --epochs 5
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A small training loop in plain PyTorch.")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048, help="size of the synthetic data set")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def make_dataset(samples: int) -> TensorDataset:
    """y = sin(x . w) + a little noise, with 16 input features."""
    x = torch.randn(samples, 16)
    w = torch.randn(16, 1) / 4
    y = torch.sin(x @ w) + 0.05 * torch.randn(samples, 1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def train(args: argparse.Namespace) -> float:
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    loader = DataLoader(make_dataset(args.samples), batch_size=args.batch_size, shuffle=True)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(x), count + len(x)

        epoch_loss = total / count
        print(f"epoch {epoch + 1} loss {epoch_loss:.8f}")
    print(f"final loss {epoch_loss:.8f} (exact {epoch_loss!r})")
    return epoch_loss


if __name__ == "__main__":
    train(parse_args())
