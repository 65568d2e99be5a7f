"""Classify handwritten digits (scikit-learn's bundled 8x8 images) with Fabric.

The same loop as ``raw_pytorch.py`` next to it; ``diff raw_pytorch.py train_fabric.py`` shows every
line Fabric changes. With Fabric the loop runs unchanged on 1 CPU, N processes, GPUs or machines:

    python examples/digits/train_fabric.py                                        # one process
    python examples/digits/train_fabric.py --accelerator cpu --devices 2 --strategy ddp
    fabric-torch run --accelerator cpu --devices 2 examples/digits/train_fabric.py      # the same, via the CLI
    python examples/digits/train_fabric.py --resume                               # continue the last run
    make demo ARGS=--resume                                                       # the same, for `make demo`

Needs the ``examples`` extra (scikit-learn, matplotlib, tqdm: ``pip install -e '.[examples]'`` in a checkout).
Writes to ``--out``: a checkpoint after every epoch (a run that starts over where one is says so first),
``loss_curve.png``, CSV logs and ``results.json``.
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


def how_to_add(options: str) -> str:
    quoted = f"'{options}'" if " " in options else options
    return f"add {options} to the command; with make: make demo ARGS={quoted}"


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
    if args.resume and not checkpoint.exists():  # said once, before any other process starts
        raise SystemExit(no_checkpoint_to_resume(checkpoint))
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

    # the loader's position (its epoch's shuffle) too, so that a resumed run draws the batches this one would have
    state = {"model": model, "optimizer": optimizer, "loader": train_loader, "epoch": 0, "history": {"train_loss": [], "val_acc": []}}
    if args.resume:
        fabric.load(checkpoint, state)
    start_epoch, history = state["epoch"], state["history"]
    note = starting_note(checkpoint, args.resume, start_epoch, args.epochs)
    if note:
        fabric.print(note)

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
        print(f"Checkpoint:  {checkpoint}  (after epoch {args.epochs})")
        print(f"To train on: {how_to_add(f'--resume --epochs {args.epochs + 4}')}")
        logs = Path(fabric.logger.log_dir)
        print(f"CSV logs:    {logs}" if logs.is_dir() else "CSV logs:    none from this run (it trained no step)")
    return results


if __name__ == "__main__":
    main(parse_args())
