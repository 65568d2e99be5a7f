"""Train a small decoder-only transformer on characters, sharded with FSDP or with tensor parallelism.

The text is this repository's own documentation (README.md and docs/), so nothing is downloaded.
The model is created on the meta device (``init_module(empty_init=True)``): no process ever holds
all of its weights; each rank allocates only its shards when ``setup_module`` shards it.

    python examples/transformer/train_fabric.py --devices 2 --strategy fsdp    # fully sharded data parallel
    python examples/transformer/train_fabric.py --devices 2 --strategy tp      # tensor parallel (x data parallel)
    python examples/transformer/train_fabric.py --devices 2 --strategy fsdp --resume   # continue the last run

Needs ``pip install -e '.[examples]'`` in a checkout of fabric (matplotlib, tqdm). Writes to ``--out``: a sharded
checkpoint folder after every epoch, ``loss_curve.png``, CSV logs, ``results.json`` and a sample.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw to files; no display needed
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from fabric import Fabric
from fabric.loggers import CSVLogger
from fabric.strategies import FSDPStrategy, ModelParallelStrategy

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "tp"], help="fsdp, or tp (tensor x data parallel)")
    parser.add_argument("--devices", type=int, default=2, help="processes on this machine")
    parser.add_argument("--tensor-parallel", type=int, default=None, help="with --strategy tp: ranks per layer (default: all)")
    parser.add_argument("--accelerator", default="cpu", help="cpu or cuda")
    parser.add_argument("--precision", default=None, help="32-true, bf16-mixed, ...")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank")
    parser.add_argument("--context", type=int, default=64, help="characters the model sees at once")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="transformer_out", help="folder for checkpoint, plot and logs")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--short", action="store_true", help="a tiny run (a few steps per epoch), for tests")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


# ---- data ------------------------------------------------------------------------------------------------


def load_text() -> str:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())


class Windows(Dataset):
    """Every ``context``-long window of the token sequence, paired with the same window shifted by one."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return len(self.tokens) - self.context - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index : index + self.context + 1]
        return window[:-1], window[1:]


# ---- model -----------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention. The head count comes from the tensors, so a tensor-parallel rank holding a
    column slice of ``q``/``k``/``v`` simply runs its share of the heads."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class DecoderOnly(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel(model: DecoderOnly, mesh) -> DecoderOnly:
    """The ``parallelize_fn`` for --strategy tp: split attention and MLP across the "tensor_parallel"
    ranks (columns in, rows out: one all-reduce per sub-layer), then shard over "data_parallel"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}  # fmt: skip
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], plan)
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


# ---- training --------------------------------------------------------------------------------------------


def save_plot(history: dict[str, list[float]], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(history["train_loss"], linewidth=0.8)
    left.set(title="training loss", xlabel="step", ylabel="cross-entropy (nats/char)")
    epochs = range(1, len(history["val_loss"]) + 1)
    right.plot(epochs, history["val_loss"], marker="o")
    right.set(title="validation loss", xlabel="epoch", ylabel="cross-entropy (nats/char)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluate(fabric: Fabric, model: nn.Module, loader: DataLoader, batches: int) -> float:
    model.eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i == batches:
                break
            logits = model(x)
            total += torch.tensor([float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")), y.numel()])
    total = fabric.all_reduce(total, reduce_op="sum")
    model.train()
    return float(total[0] / total[1])


@torch.no_grad()
def sample(model: nn.Module, start: torch.Tensor, length: int, context: int) -> list[int]:
    """Greedy continuation of ``start`` (every rank runs it: the sharded forward is a collective)."""
    model.eval()
    idx = start[None]
    for _ in range(length):
        logits = model(idx[:, -context:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train()
    return idx[0].tolist()


def make_strategy(args: argparse.Namespace):
    if args.strategy == "fsdp":
        return FSDPStrategy(auto_wrap_policy={Block})
    tensor = args.tensor_parallel or args.devices
    return ModelParallelStrategy(tensor_parallel, data_parallel_size=args.devices // tensor, tensor_parallel_size=tensor)


def main(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    fabric = Fabric(accelerator=args.accelerator, strategy=make_strategy(args), devices=args.devices,
                    precision=args.precision, loggers=CSVLogger(out, name="logs"))  # fmt: skip
    fabric.launch()  # starts the other processes
    fabric.seed_everything(args.seed)

    text = load_text()
    vocab = sorted(set(text))
    tokens = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(tokens))
    train_loader = fabric.setup_dataloaders(DataLoader(Windows(tokens[:split], args.context), batch_size=args.batch_size, shuffle=True))
    val_loader = fabric.setup_dataloaders(DataLoader(Windows(tokens[split:], args.context), batch_size=args.batch_size))

    with fabric.init_module(empty_init=True):  # on the meta device: no memory yet
        model = DecoderOnly(len(vocab), args.context, args.width, args.layers, args.heads)
    model = fabric.setup_module(model)  # shards, then allocates and initializes only this rank's shards
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))

    checkpoint = out / "checkpoint"
    state = {"model": model, "optimizer": optimizer, "epoch": 0, "history": {"train_loss": [], "val_loss": []}}
    if args.resume:
        if not checkpoint.exists():
            raise FileNotFoundError(f"--resume: there is no checkpoint at {checkpoint}")
        fabric.load(checkpoint, state)
        fabric.print(f"Resuming from {checkpoint} after epoch {state['epoch']}")
    start_epoch, history = state["epoch"], state["history"]
    steps = 3 if args.short else args.steps_per_epoch
    val_batches = 2 if args.short else 20

    started = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        batches = iter(train_loader)
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", disable=not fabric.is_global_zero)
        for _ in bar:
            x, y = next(batches)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            history["train_loss"].append(loss.item())
            fabric.log("train/loss", loss.item(), step=len(history["train_loss"]))
            bar.set_postfix(loss=f"{loss.item():.3f}")
        val_loss = evaluate(fabric, model, val_loader, val_batches)
        history["val_loss"].append(val_loss)
        fabric.log_dict({"val/loss": val_loss, "epoch": epoch + 1}, step=len(history["train_loss"]))
        fabric.print(f"epoch {epoch + 1}: validation loss {val_loss:.3f} nats/char (perplexity {math.exp(val_loss):.1f})")
        state["epoch"] = epoch + 1
        fabric.save(checkpoint, state)  # every rank writes its own shards into the folder

    prompt = tokens[split : split + 16].to(fabric.device)
    text_out = "".join(vocab[i] for i in sample(model, prompt, 8 if args.short else 120, args.context))
    results = {
        "val_loss": history["val_loss"][-1] if history["val_loss"] else None,
        "start_epoch": start_epoch,
        "epochs": args.epochs,
        "world_size": fabric.world_size,
        "strategy": args.strategy,
        "seconds": time.perf_counter() - started,
    }
    if fabric.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        save_plot(history, out / "loss_curve.png")
        (out / "sample.txt").write_text(text_out, encoding="utf-8")
        (out / "results.json").write_text(json.dumps(results, indent=2))
        fabric.logger.finalize("success")
        print(f"Final validation loss: {results['val_loss']:.3f} nats/char, {fabric.world_size} processes ({args.strategy})")
        print(f"Sample:      {text_out!r}")
        print(f"Loss curve:  {out / 'loss_curve.png'}")
        print(f"Checkpoint:  {checkpoint}  (continue with --resume)")
    return results


if __name__ == "__main__":
    main(parse_args())
