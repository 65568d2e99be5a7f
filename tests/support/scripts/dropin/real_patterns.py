"""Patterns real Lightning Fabric programs rely on, in one 2-process job. Each rank writes what it saw.

    python -m fabric run --accelerator cpu --devices 2 real_patterns.py OUT          (Fabric() under `fabric run`)
    python real_patterns.py OUT --launch popen|spawn                                 (fabric.launch() starts the ranks)

Seen per rank, in OUT/rank<R>.json:
* whether torch.distributed works straight after ``Fabric()`` (learn2learn's optimizer calls it there);
* whether joining the group and setting up left torch's generator where seeding and model creation put it
  (and, in a spawned worker, which starts unseeded, whether it took the seed);
* the thread count each rank runs with;
* a LightningModule-style module (a ``_fabric`` attribute, step methods, hooks): what it reaches through
  ``_fabric``, whether its ``training_step`` ran through DDP (its gradients agree over the ranks although the
  ranks' data differ), and whether its hook runs through ``fabric.call``;
* what ``logger.experiment`` is on each rank, and that calling anything on it works.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fabric import Fabric, seed_everything
from fabric.loggers import CSVLogger


class LightningStyleModule(nn.Module):
    """What fabric recognises of a LightningModule: the ``_fabric`` attribute, step methods, hooks."""

    def __init__(self) -> None:
        super().__init__()
        self._fabric: Any = None
        self._fabric_optimizers: list[Any] = []
        self.layer = nn.Linear(4, 1)
        self.epoch_ends = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self(batch).pow(2).mean()
        self._fabric.log_dict({"loss": loss.detach()})  # what LightningModule.log does under Fabric
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_ends += 1


def run(fabric: Fabric, out: Path, rng_before_join: torch.Tensor, joined_at_creation: bool) -> None:
    rank = fabric.global_rank
    rng_kept_by_join = torch.equal(rng_before_join, torch.get_rng_state())
    rng_is_seed_state = torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(3).get_state())
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # straight torch.distributed, before any setup()

    model = LightningStyleModule()
    rng_before_setup = torch.get_rng_state()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, wrapped_optimizer = fabric.setup(model, optimizer)
    rng_untouched = torch.equal(torch.get_rng_state(), rng_before_setup)

    batch = torch.full((2, 4), float(rank + 1))  # different data on each rank
    loss = wrapped.training_step(batch)
    fabric.backward(loss)
    grads = fabric.all_gather(model.layer.weight.grad.clone())
    fabric.call("on_train_epoch_end")

    logger = fabric.logger
    experiment = logger.experiment
    if rank > 0:  # any call, as a script written for TensorBoard's SummaryWriter makes on every rank
        experiment.add_text("hyperparameters", "anything")
        experiment[0].add_image("x", None)
    report = {
        "joined_at_creation": joined_at_creation,
        "all_reduce": total.item(),
        "rng_kept_by_join": rng_kept_by_join,
        "rng_is_seed_state": rng_is_seed_state,
        "rng_kept_by_setup": rng_untouched,
        "threads": torch.get_num_threads(),
        "module_fabric_is_ours": model._fabric is fabric,
        "module_optimizers": [o is wrapped_optimizer for o in model._fabric_optimizers],
        "module_is_callback": model.epoch_ends == 1,
        "grads_agree": bool(torch.allclose(grads[0], grads[1])),
        "experiment": type(experiment).__name__,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    logger.finalize("success")


def main() -> None:
    out = Path(sys.argv[1])
    launch = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--launch" else None
    seed_everything(3)
    torch.nn.Linear(8, 8)  # draws after seeding (a model's initial weights) that a reseed would replay
    rng_before_join = torch.get_rng_state()
    logger = CSVLogger(out, name="csv", flush_logs_every_n_steps=1)
    if launch is None:
        fabric = Fabric(loggers=logger)  # `fabric run` gives the accelerator, devices and strategy
        joined = dist.is_available() and dist.is_initialized()
        run(fabric, out, rng_before_join, joined)
    elif launch == "popen":
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=logger)
        joined = dist.is_available() and dist.is_initialized()
        fabric.launch()
        run(fabric, out, rng_before_join, joined)
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn", loggers=logger)
        fabric.launch(_spawned, out)


def _spawned(fabric: Fabric, out: Path) -> None:
    # a spawned worker starts unseeded: it takes the seed from the environment when it joins the group
    run(fabric, out, torch.get_rng_state(), False)


if __name__ == "__main__":
    main()
