"""Classify handwritten digits (scikit-learn's bundled 8x8 images) with plain PyTorch.

The starting point for ``train_fabric.py`` next to it: one process, one device, everything by hand.
``diff raw_pytorch.py train_fabric.py`` shows what changes with Fabric.

    python examples/digits/raw_pytorch.py
    python examples/digits/raw_pytorch.py --resume      # continue the last run

Needs scikit-learn, matplotlib and tqdm. Writes to ``--out``: a checkpoint after every epoch,
``loss_curve.png`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw to files; no display needed
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from tqdm import tqdm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="digits_out_raw", help="folder for checkpoint and plot")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--short", action="store_true", help="a tiny run (a few batches per epoch), for tests")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def make_datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """1797 images of 8x8 pixels (values 0..16) split 80/20."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = len(labels) // 5
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))


class Accuracy:
    """Correct and total counts over the validation set."""

    def __init__(self) -> None:
        self.correct = 0
        self.total = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.correct += int((logits.argmax(dim=1) == labels).sum())
        self.total += labels.numel()

    def compute(self) -> tuple[float, int, int]:
        return self.correct / max(self.total, 1), self.correct, self.total


def save_plot(history: dict[str, list[float]], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(history["train_loss"], linewidth=0.8)
    left.set(title="training loss", xlabel="step", ylabel="cross-entropy")
    epochs = range(1, len(history["val_acc"]) + 1)
    right.plot(epochs, [100 * a for a in history["val_acc"]], marker="o")
    right.set(title="validation accuracy", xlabel="epoch", ylabel="%")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluate(model: nn.Module, val_loader: DataLoader, device: torch.device) -> tuple[float, int, int]:
    model.eval()
    metric = Accuracy()
    with torch.no_grad():
        for images, labels in val_loader:
            images, labels = images.to(device), labels.to(device)
            metric.update(model(images), labels)
    return metric.compute()


def how_to_add(options: str) -> str:
    return f"add {options} to the command"


def starting_note(checkpoint: Path, resumed: bool, start_epoch: int, epochs: int) -> str | None:
    """What to say before training. A run that starts over where a checkpoint is says so (its first epoch replaces
    it) and how to continue that run instead; a resumed run says where it goes on, or that it has nothing left."""
    if resumed and start_epoch >= epochs:
        return (
            f"The run in {checkpoint} has finished its {start_epoch} epochs: nothing to train."
            f" To train on: {how_to_add(f'--resume --epochs {start_epoch + 4}')}"
        )
    if resumed:
        return f"Resuming from {checkpoint} after epoch {start_epoch} of {epochs}"
    if checkpoint.exists():
        return (
            f"Starting over: {checkpoint} holds an earlier run, which this run's first epoch replaces."
            f" To continue that run instead: {how_to_add('--resume')}"
        )
    return None


def no_checkpoint_to_resume(checkpoint: Path) -> str:
    return f"--resume: there is no checkpoint at {checkpoint} (without --resume a new run starts and writes one)"


def main(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    checkpoint = out / "checkpoint.pt"
    if args.resume and not checkpoint.exists():
        raise SystemExit(no_checkpoint_to_resume(checkpoint))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    train_set, val_set = make_datasets()
    if args.short:
        train_set = Subset(train_set, range(4 * args.batch_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=256)

    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    state = {"epoch": 0, "history": {"train_loss": [], "val_acc": []}}
    if args.resume:
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = {"epoch": saved["epoch"], "history": saved["history"]}
    start_epoch, history = state["epoch"], state["history"]
    note = starting_note(checkpoint, args.resume, start_epoch, args.epochs)
    if note:
        print(note)

    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        model.train()
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}")
        for images, labels in bar:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history["train_loss"].append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")

        accuracy, correct, total = evaluate(model, val_loader, device)
        history["val_acc"].append(accuracy)
        print(f"epoch {epoch + 1}: validation accuracy {100 * accuracy:.1f}% ({correct}/{total})")

        state["epoch"] = epoch + 1
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state}, checkpoint)
    if start_epoch >= args.epochs:  # resumed a finished run: just report it
        accuracy, correct, total = evaluate(model, val_loader, device)

    results = {
        "val_acc": accuracy,
        "val_correct": correct,
        "val_total": total,
        "start_epoch": start_epoch,
        "epochs": args.epochs,
        "world_size": 1,
        "seconds": time.perf_counter() - started,
    }
    plot = out / "loss_curve.png"
    save_plot(history, plot)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"Final validation accuracy: {100 * accuracy:.1f}% over {total} images")
    print(f"Loss curve:  {plot}")
    print(f"Checkpoint:  {checkpoint}  (after epoch {args.epochs})")
    print(f"To train on: {how_to_add(f'--resume --epochs {args.epochs + 4}')}")
    return results


if __name__ == "__main__":
    main(parse_args())
