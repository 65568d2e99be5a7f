"""Classify handwritten digits (scikit-learn's bundled 8x8 images) with Fabric.

The same loop as ``raw_pytorch.py`` next to it; ``diff raw_pytorch.py train_fabric.py`` shows every
line Fabric changes. With Fabric the loop runs unchanged on 1 CPU, N processes, GPUs or machines:

    python examples/digits/train_fabric.py                                        # one process
    python examples/digits/train_fabric.py --accelerator cpu --devices 2 --strategy ddp
    fabric-torch run --accelerator cpu --devices 2 examples/digits/train_fabric.py      # the same, via the CLI
    python examples/digits/train_fabric.py --resume                               # continue the last run

Needs ``pip install fabric-torch[examples]`` (scikit-learn, matplotlib, tqdm). Writes to ``--out``:
a checkpoint after every epoch, ``loss_curve.png``, CSV logs and ``results.json``.
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

from fabric import Fabric
from fabric.loggers import CSVLogger


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.01)
    # Fabric's defaults: under `fabric-torch run` the command line's options fill them in
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, mps, gpu or auto")
    parser.add_argument("--strategy", default="auto", help="auto, ddp, ...")
    parser.add_argument("--devices", default="auto", help="number of devices (processes) per node")
    parser.add_argument("--precision", default=None, help="32-true, bf16-mixed, ...")
    parser.add_argument("--out", default="digits_out", help="folder for checkpoint, plot and logs")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--short", action="store_true", help="a tiny run (a few batches per epoch), for tests")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def make_datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """1797 images of 8x8 pixels (values 0..16) split 80/20; the same split in every process."""
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
    """Correct and total counts; ``compute`` sums them over all processes before dividing.

    Averaging each process's accuracy would weigh processes with fewer samples too much; summing the
    counts gives exactly the accuracy on the whole validation set.
    """

    def __init__(self) -> None:
        self.correct = 0
        self.total = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.correct += int((logits.argmax(dim=1) == labels).sum())
        self.total += labels.numel()

    def compute(self, fabric: Fabric) -> tuple[float, int, int]:
        counts = fabric.all_reduce(torch.tensor([self.correct, self.total]), reduce_op="sum")
        correct, total = (int(c) for c in counts)
        return correct / max(total, 1), correct, total


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


def evaluate(fabric: Fabric, model: nn.Module, val_loader: DataLoader) -> tuple[float, int, int]:
    model.eval()
    metric = Accuracy()
    with torch.no_grad():
        for images, labels in val_loader:
            metric.update(model(images), labels)
    return metric.compute(fabric)


def main(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    devices = int(args.devices) if str(args.devices).lstrip("-").isdigit() else args.devices
    fabric = Fabric(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=devices,
        precision=args.precision,
        loggers=CSVLogger(out, name="logs"),
    )
    fabric.launch()  # with --devices N this starts the other N-1 processes (nothing under `fabric-torch run`)
    fabric.seed_everything(args.seed)

    train_set, val_set = make_datasets()
    if args.short:
        train_set = Subset(train_set, range(4 * args.batch_size * fabric.world_size))
    # Each process validates its own slice (rank, rank + world_size, ...), so every image counts once.
    val_slice = Subset(val_set, range(fabric.global_rank, len(val_set), fabric.world_size))
    train_loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=args.batch_size, shuffle=True))
    val_loader = fabric.setup_dataloaders(DataLoader(val_slice, batch_size=256), use_distributed_sampler=False)

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)

    checkpoint = out / "checkpoint.pt"
    state = {"model": model, "optimizer": optimizer, "epoch": 0, "history": {"train_loss": [], "val_acc": []}}
    if args.resume:
        if not checkpoint.exists():
            raise FileNotFoundError(f"--resume: there is no checkpoint at {checkpoint}")
        fabric.load(checkpoint, state)
        fabric.print(f"Resuming from {checkpoint} after epoch {state['epoch']}")
    start_epoch, history = state["epoch"], state["history"]

    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        model.train()  # (the loader Fabric set up reshuffles its shards every epoch by itself)
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not fabric.is_global_zero)
        for images, labels in bar:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            history["train_loss"].append(loss.item())
            fabric.log("train/loss", loss.item(), step=len(history["train_loss"]))
            bar.set_postfix(loss=f"{loss.item():.3f}")

        accuracy, correct, total = evaluate(fabric, model, val_loader)
        history["val_acc"].append(accuracy)
        fabric.log_dict({"val/acc": accuracy, "epoch": epoch + 1}, step=len(history["train_loss"]))
        fabric.print(f"epoch {epoch + 1}: validation accuracy {100 * accuracy:.1f}% ({correct}/{total})")

        state["epoch"] = epoch + 1
        fabric.save(checkpoint, state)  # every process calls it; rank 0 writes the file
    if start_epoch >= args.epochs:  # resumed a finished run: just report it
        accuracy, correct, total = evaluate(fabric, model, val_loader)

    results = {
        "val_acc": accuracy,
        "val_correct": correct,
        "val_total": total,
        "start_epoch": start_epoch,
        "epochs": args.epochs,
        "world_size": fabric.world_size,
        "seconds": time.perf_counter() - started,
    }
    if fabric.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        plot = out / "loss_curve.png"
        save_plot(history, plot)
        fabric.logger.finalize("success")
        (out / "results.json").write_text(json.dumps(results, indent=2))
        print(f"Final validation accuracy: {100 * accuracy:.1f}% over {total} images, {fabric.world_size} process(es)")
        print(f"Loss curve:  {plot}")
        print(f"Checkpoint:  {checkpoint}  (continue with --resume)")
        print(f"CSV logs:    {fabric.logger.log_dir}")
    return results


if __name__ == "__main__":
    main(parse_args())
