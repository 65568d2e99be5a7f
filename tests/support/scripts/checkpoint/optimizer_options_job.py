"""Optimizer group options after a load, in every rank of ``torchrun --nproc-per-node 2 optimizer_options_job.py OUTDIR``.

For each strategy (and checkpoint format) a job trains one step with ``AdamW(betas=(0.8, 0.95))`` and saves
with ``fabric.save``; fresh set-ups with AdamW's defaults then ``fabric.load`` that checkpoint, and
``fabric.load_raw`` a plain ``torch.save(optimizer.state_dict())`` of a one-process AdamW with the same
options. Each load must leave every group option as saved, with the saved type (AdamW's betas a tuple).
Rank r records what it found in ``OUTDIR/rank{r}.json``; the test asserts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fabric import Fabric
from fabric.strategies import FSDPStrategy, ModelParallelStrategy
from support.scripts.sharding.model import IN, OUT, make_net, parallelize

OPTIONS = {"lr": 0.05, "betas": (0.8, 0.95), "weight_decay": 0.03}  # AdamW's defaults differ in each

STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: "ddp",
    "fsdp": FSDPStrategy,
    "fsdp_full": lambda: FSDPStrategy(state_dict_type="full"),
    "model_parallel": lambda: ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2),
    "model_parallel_full": lambda: ModelParallelStrategy(
        parallelize, data_parallel_size=1, tensor_parallel_size=2, save_distributed_checkpoint=False
    ),
}


def group_options(groups: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Each group's options but "params", as ``repr`` (a tuple and a list of the same numbers differ)."""
    return [{name: repr(value) for name, value in group.items() if name != "params"} for group in groups]


def set_up(make_strategy: Callable[[], Any], **options: Any) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=make_strategy())
    fabric.launch()
    model = fabric.setup_module(make_net())
    return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **options))


def step(model: Any, optimizer: Any, backward: Callable[[torch.Tensor], None]) -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, IN, generator=generator), torch.randn(4, OUT, generator=generator)
    backward(F.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def raw_optimizer_state() -> dict[str, Any]:
    """A plain one-process AdamW's ``state_dict()`` after one step (what ``torch.save`` of it holds)."""
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIONS)
    step(model, optimizer, lambda loss: loss.backward())
    return optimizer.state_dict()


def check(name: str, make_strategy: Callable[[], Any], folder: Path, raw: Path, raw_options: list[dict[str, str]]) -> dict[str, Any]:
    fabric, model, optimizer = set_up(make_strategy, **OPTIONS)
    step(model, optimizer, fabric.backward)
    saved = group_options(optimizer.param_groups)
    path = folder / name
    fabric.save(path, {"model": model, "optimizer": optimizer})

    fabric, model, optimizer = set_up(make_strategy)  # AdamW's default options: the load must replace them
    fabric.load(path, {"model": model, "optimizer": optimizer})
    loaded = group_options(optimizer.param_groups)
    loaded_betas = optimizer.param_groups[0]["betas"]

    fabric, model, optimizer = set_up(make_strategy)
    fabric.load_raw(raw, optimizer)
    raw_loaded = group_options(optimizer.param_groups)
    raw_betas = optimizer.param_groups[0]["betas"]
    return {
        "format": "file" if path.is_file() else "folder",
        "load": {"saved": saved, "loaded": loaded, "betas": repr(loaded_betas), "betas_type": type(loaded_betas).__name__},
        "load_raw": {"saved": raw_options, "loaded": raw_loaded, "betas": repr(raw_betas), "betas_type": type(raw_betas).__name__},
    }


def main() -> None:
    outdir = Path(sys.argv[1])
    folder = outdir / "checkpoints"
    folder.mkdir(exist_ok=True)
    raw, raw_state = outdir / "raw_optimizer.pt", raw_optimizer_state()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    if fabric.global_rank == 0:
        torch.save(raw_state, raw)
    fabric.barrier()
    raw_options = group_options(raw_state["param_groups"])
    results = {name: check(name, make_strategy, folder, raw, raw_options) for name, make_strategy in STRATEGIES.items()}
    (outdir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
