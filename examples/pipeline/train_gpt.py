"""Train a small GPT with pipeline parallelism: 2 pipeline stages x 2 data-parallel ranks on 4 CPU processes.

The model (token and position embeddings, a few transformer blocks with causal self-attention, a head) is cut into
stages at the blocks named in ``pipeline_split``; each stage is sharded with ``fully_shard`` over its data-parallel
ranks; torch's 1F1B schedule runs forward and backward over the microbatches. The text is synthetic (lines of
sums, ``"37+5=42"``), made here from a seed, so nothing is downloaded.

    python examples/pipeline/train_gpt.py                                                     # pp=2 x dp=2, 4 processes
    python examples/pipeline/train_gpt.py --pipeline-parallel-size 1 --data-parallel-size 1   # the same, one process
    python examples/pipeline/train_gpt.py --schedule Interleaved1F1B                          # 2 stages per rank

The same arguments give the same microbatches whatever the layout (``--batch-size`` is the whole step's batch over
every data-parallel rank, ``--microbatch-size`` the rows of one microbatch), so the one-process run's losses equal
the pipeline's to float32 rounding. ``--json PATH``: rank 0 writes the losses there.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric
from fabric.strategies import ModelParallelStrategy

#: Schedules that run two stages per rank (the others: one).
TWO_STAGES_PER_RANK = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline-parallel-size", type=int, default=2, help="ranks the stages are spread over")
    parser.add_argument("--data-parallel-size", type=int, default=2, help="ranks that see different data")
    parser.add_argument("--schedule", default="1F1B", help="1F1B, GPipe, Interleaved1F1B, ZBVZeroBubble, ...")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per step, over every data-parallel rank")
    parser.add_argument("--microbatch-size", type=int, default=4, help="rows per microbatch")
    parser.add_argument("--context", type=int, default=32, help="characters the model sees at once")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (a multiple of the stages)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the step losses here")
    return parser.parse_args(argv)


# ---- data ------------------------------------------------------------------------------------------------

VOCABULARY = "0123456789+=\n"


def synthetic_text(lines: int, seed: int) -> str:
    """Lines ``a+b=c`` with a, b below 100: the digits after '=' follow from the ones before, so the loss can fall."""
    draw = random.Random(seed)
    return "".join(f"{a}+{b}={a + b}\n" for a, b in ((draw.randrange(100), draw.randrange(100)) for _ in range(lines)))


class Windows(Dataset):
    """Every ``context``-long window of the tokens, paired with the same window shifted by one."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return len(self.tokens) - self.context - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index : index + self.context + 1]
        return window[:-1], window[1:]


# ---- model -----------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        # is_causal builds the mask inside the kernel: nothing data-dependent for the tracer that splits the model
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """No weight tying: the token embedding sits on the first stage and the head on the last."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shard_over_data_parallel(module: nn.Module, mesh) -> nn.Module:
    """The ``parallelize_fn``: called once per stage of this rank, with the ("data_parallel", "tensor_parallel")
    mesh. A stage holds some of the blocks (under their whole-model names), each sharded on its own."""
    from torch.distributed.fsdp import fully_shard

    data_parallel = mesh["data_parallel"]
    for block in [child for child in module.modules() if isinstance(child, Block)]:
        fully_shard(block, mesh=data_parallel)
    return fully_shard(module, mesh=data_parallel)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One microbatch's loss: cross-entropy of every position's next character."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# ---- training --------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> list[float]:
    pipeline, data = args.pipeline_parallel_size, args.data_parallel_size
    if args.batch_size % (data * args.microbatch_size):
        raise ValueError(f"--batch-size {args.batch_size} must divide into {data} data-parallel ranks x microbatches of {args.microbatch_size}")
    microbatches = args.batch_size // (data * args.microbatch_size)  # per data-parallel rank
    stages = pipeline * (2 if args.schedule in TWO_STAGES_PER_RANK else 1)
    if args.layers % stages:
        raise ValueError(f"--layers {args.layers} must divide into {stages} stages")
    split = [f"blocks.{stage * args.layers // stages}" for stage in range(1, stages)]  # where a stage begins
    strategy = ModelParallelStrategy(
        shard_over_data_parallel,
        data_parallel_size=data,
        tensor_parallel_size=1,
        pipeline_parallel_size=pipeline,
        pipeline_split=split,
        pipeline_schedule=args.schedule,
        microbatches=microbatches,
    )
    fabric = Fabric(accelerator="cpu", devices=pipeline * data, strategy=strategy)
    fabric.launch()  # starts the other processes
    fabric.seed_everything(args.seed)

    tokens = torch.tensor([VOCABULARY.index(c) for c in synthetic_text(4000, args.seed)], dtype=torch.long)
    held_out = int(0.9 * len(tokens))
    # every stage of one data-parallel rank reads the same batches: the loader is sharded over data parallelism only
    per_rank = args.batch_size // data
    train = fabric.setup_dataloaders(DataLoader(Windows(tokens[:held_out], args.context), batch_size=per_rank, shuffle=True))
    val = fabric.setup_dataloaders(DataLoader(Windows(tokens[held_out:], args.context), batch_size=per_rank))

    model = fabric.setup_module(GPT(len(VOCABULARY), args.context, args.width, args.layers, args.heads))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))

    losses = []
    batches = iter(train)
    for step in range(args.steps):
        x, y = next(batches)
        optimizer.zero_grad()
        # in place of model(x) and fabric.backward(loss): the schedule runs forward and backward over the microbatches
        loss = fabric.pipeline_step(model, x, target=y, loss_fn=next_token_loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            fabric.print(f"step {step} loss {loss.item():.6f}")

    x, y = next(iter(val))
    val_loss = fabric.pipeline_step(model, x, target=y, loss_fn=next_token_loss, backward=False).item()
    fabric.print(f"validation loss {val_loss:.6f} ({math.exp(val_loss):.2f} perplexity)")
    layout = f"pp={pipeline} x dp={data}, {args.schedule}, {microbatches} microbatch(es) of {args.microbatch_size} per rank"
    fabric.print(f"{fabric.world_size} process(es), {layout}")
    if args.json is not None and fabric.is_global_zero:
        args.json.write_text(json.dumps({"losses": losses, "val_loss": val_loss, "world_size": fabric.world_size}))
    return losses


if __name__ == "__main__":
    main(parse_args())
