"""One rank plays, the others train: groups made with ``TorchCollective`` beside the strategy's, as Lightning's
decoupled reinforcement-learning example arranges them. Run with 3 processes:

    python -m fabric run --accelerator cpu --devices 3 decoupled.py OUT

Rank 0 (the player) sends data to every rank over the world group; ranks 1 and 2 train one model with DDP
over a group of their own (``DDPStrategy(process_group=...)``); rank 1 sends the trained weights back to the
player over the group of ranks 0 and 1. Each rank writes OUT/rank<R>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from fabric import Fabric
from fabric.plugins.collectives import TorchCollective
from fabric.plugins.collectives.collective import CollectibleGroup
from fabric.strategies import DDPStrategy

STEPS = 3


def player(world: TorchCollective, player_trainer: TorchCollective, out: Path) -> None:
    Fabric(accelerator="cpu")  # a Fabric of its own, as the example makes: it must not disturb the groups
    weights = torch.zeros(5)
    for step in range(STEPS):
        world.broadcast_object_list([{"x": torch.full((4, 4), float(step + 1))}], src=0)
        player_trainer.broadcast(weights, src=1)
    world.broadcast_object_list([None], src=0)
    (out / "rank0.json").write_text(json.dumps({"weights": weights.tolist(), "group_size": player_trainer.world_size}))


def trainer(world: TorchCollective, player_trainer: TorchCollective, trainers: CollectibleGroup, out: Path) -> None:
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(process_group=trainers))
    torch.manual_seed(world.rank)  # different initial weights: DDP must make them agree
    module = nn.Linear(4, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    while True:
        box = [None]
        world.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        x = box[0]["x"][world.rank - 1 :: 2]  # each trainer its half of the data
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        vector = parameters_to_vector(model.parameters()).detach()
        if world.rank == 1:
            player_trainer.broadcast(vector, src=1)
    (out / f"rank{world.rank}.json").write_text(json.dumps({"weights": vector.tolist()}))


def main() -> None:
    out = Path(sys.argv[1])
    world = TorchCollective()
    player_trainer = TorchCollective()
    world.setup(backend="gloo")
    world.create_group()
    player_trainer.create_group(ranks=[0, 1])
    trainers = world.new_group(ranks=list(range(1, world.world_size)))
    if world.rank == 0:
        player(world, player_trainer, out)
    else:
        trainer(world, player_trainer, trainers, out)
    player_trainer.teardown()
    world.teardown()


if __name__ == "__main__":
    main()
