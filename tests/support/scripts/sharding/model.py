"""A tiny residual MLP for the sharded-strategy jobs, its tensor-parallel plan and a one-process reference run."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IN, DIM, HIDDEN, OUT = 8, 16, 32, 4
GLOBAL_BATCH = 8
MAX_STEPS = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_net(seed: int = 0, blocks: int = 2) -> Net:
    torch.manual_seed(seed)
    return Net(blocks)


def data(steps: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``steps`` global batches of one fixed sequence (a longer run starts with the same batches)."""
    generator = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(MAX_STEPS, GLOBAL_BATCH, IN, generator=generator), torch.randn(MAX_STEPS, GLOBAL_BATCH, OUT, generator=generator)
    return xs[:steps], ys[:steps]


def parallelize(module: Net, mesh: Any) -> Net:
    """Tensor parallel inside each block (up: columns, down: rows), then fully_shard over the data dimension."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in module.blocks:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def reference_run(steps: int, max_norm: float | None, lr: float = 0.05) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train on the whole global batch in this one process: the result every sharded run must match."""
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    xs, ys = data(steps)
    norms = []
    for x, y in zip(xs, ys):
        F.mse_loss(model(x), y).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective for sharded ones: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().clone()
    return out


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)
