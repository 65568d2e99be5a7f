"""One optimizer over two set-up modules of a rank, in every rank of ``torchrun --nproc-per-node 2 stages_job.py OUTDIR``.

A model of four layers is cut into two stages that keep the model's names (``layers.0``, ``layers.1`` in the first,
``layers.2``, ``layers.3`` in the second), as pipeline stages do; FSDP shards each stage, and one AdamW trains both.
After a step the job saves ``{"stage0", "stage1", "optimizer"}`` as a folder of shards and as a full file, and loads
each into fresh stages and a fresh AdamW; then ``load_raw`` puts a plain ``optimizer.state_dict()`` of the whole
model's AdamW (one process, the same step) into a fresh AdamW over the two stages. Rank r records in
``OUTDIR/rank{r}.json`` whether every optimizer state and weight came back, and the optimizer names the folder keeps.
"""

from __future__ import annotations

import copy
import json
import sys
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fabric import Fabric
from fabric.strategies import FSDPStrategy

WIDTH = 16


class Stack(nn.Module):
    """Layers applied in the order of their names; a stage is a copy holding some of them, under the same names."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(index): nn.Linear(WIDTH, WIDTH) for index in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def whole_model(seed: int) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def stages(seed: int) -> tuple[Stack, Stack]:
    model = whole_model(seed)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for name in ("2", "3"):
        del first.layers[name]
    for name in ("0", "1"):
        del second.layers[name]
    return first, second


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator)


def set_up(state_dict_type: str, seed: int) -> tuple[Fabric, Any, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type=state_dict_type))
    fabric.launch()
    first, second = (fabric.setup_module(stage) for stage in stages(seed))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(chain(first.parameters(), second.parameters()), lr=0.1))
    return fabric, first, second, optimizer


def trained(state_dict_type: str) -> tuple[Fabric, Any, Any, Any]:
    fabric, first, second, optimizer = set_up(state_dict_type, seed=1)
    x, y = batch()
    fabric.backward(F.mse_loss(second(first(x)), y))
    optimizer.step()
    return fabric, first, second, optimizer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def moments(optimizer: Any) -> list[torch.Tensor]:
    """Every parameter's AdamW state, whole, in the optimizer's order of parameters."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return [full(optimizer.state[param][name]).detach().clone() for param in params for name in ("exp_avg", "exp_avg_sq")]


def weights(*modules: Any) -> list[torch.Tensor]:
    return [full(param).detach().clone() for module in modules for param in module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))


def round_trip(state_dict_type: str, path: Path) -> dict[str, Any]:
    fabric, first, second, optimizer = trained(state_dict_type)
    saved_moments, saved_weights = moments(optimizer), weights(first, second)
    fabric.save(path, {"stage0": first, "stage1": second, "optimizer": optimizer})
    fabric, first, second, optimizer = set_up(state_dict_type, seed=2)
    fabric.load(path, {"stage0": first, "stage1": second, "optimizer": optimizer})
    return {"moments": same(moments(optimizer), saved_moments), "weights": same(weights(first, second), saved_weights)}


def raw_optimizer_state() -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A one-process AdamW over the whole model after the same step: its ``state_dict()`` and its moments."""
    model = whole_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    return optimizer.state_dict(), moments(optimizer)


def main() -> None:
    outdir = Path(sys.argv[1])
    results = {
        "folder": round_trip("sharded", outdir / "sharded"),
        "file": round_trip("full", outdir / "full.pt"),
    }
    raw_state, raw_moments = raw_optimizer_state()
    raw = outdir / "raw_optimizer.pt"
    fabric, _, _, optimizer = set_up("sharded", seed=2)
    if fabric.global_rank == 0:
        torch.save(raw_state, raw)
    fabric.barrier()
    fabric.load_raw(raw, optimizer)
    results["load_raw"] = {"moments": same(moments(optimizer), raw_moments)}
    objects = torch.load(outdir / "sharded" / "fabric-objects.pt", weights_only=True)
    results["optimizer_names"] = sorted({path[2] for path in objects["tensors"].values() if path[0] == "optimizer" and path[1] == "state"})
    (outdir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
