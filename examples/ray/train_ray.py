"""A Fabric loop under Ray Train that resumes exactly after a worker dies (docs/ray.md).

Ray Train's ``TorchTrainer`` starts the workers, joins them into a process group and, with
``FailureConfig(max_failures=N)``, starts them all again when one dies. Fabric runs inside each worker
on that process group; the state saved with ``fabric.save`` (model, optimizer, the loader's position and
every rank's random state) goes to Ray as the run's checkpoint, and a restarted attempt loads the latest
one with ``fabric.load`` and continues as if nothing had happened.

    pip install -e '.[ray]'                                               # in a checkout of fabric
    python examples/ray/train_ray.py --out /tmp/ray-run                   # 2 CPU workers, uninterrupted
    python examples/ray/train_ray.py --out /tmp/ray-kill --fail-at 23     # worker 1 SIGKILLs itself at step 23, once

Each run writes ``<out>/losses.jsonl`` (per step: both ranks' losses, as ``float.hex``, and the step the
attempt resumed from) and ``<out>/final.pt`` (the trained weights).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

STATE_FILE = "state.ckpt"


def make_dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)  # the same data in every worker and every attempt
    x = torch.randn(samples, 16, generator=generator)
    y = torch.sin(x @ torch.randn(16, 1, generator=generator) / 4)
    return TensorDataset(x, y)


def train_func(config: dict[str, Any]) -> None:
    """Runs in every Ray worker, in every attempt."""
    import ray.train

    context = ray.train.get_context()
    # Ray has already joined the workers into a process group (gloo here, nccl with GPUs) and exported
    # RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT. Fabric
    # sees LOCAL_RANK (started from outside: it starts no process) and joins the group that exists.
    local_world_size = context.get_local_world_size()
    fabric = Fabric(
        accelerator=config["accelerator"],
        strategy="ddp",
        devices=local_world_size,
        num_nodes=context.get_world_size() // local_world_size,
    )
    fabric.launch()
    assert fabric.global_rank == context.get_world_rank(), "every node must hold the same number of workers"
    fabric.seed_everything(config["seed"])

    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(make_dataset(config["samples"]), batch_size=config["batch_size"], shuffle=True)
    loader = fabric.setup_dataloaders(loader)

    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "epoch": 0}
    checkpoint = ray.train.get_checkpoint()  # the latest one reported, the same for every worker; None at first
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            fabric.load(Path(folder) / STATE_FILE, state)  # weights, optimizer, data position, random generators
    resumed_from = state["step"]

    out = Path(config["out"])
    for epoch in range(state["epoch"], config["epochs"]):
        for x, y in loader:
            step = state["step"] + 1
            if step == config["fail_at"] and context.get_world_rank() == 1:
                marker = out / "killed"
                if not marker.exists():  # once: the restarted attempt goes past this step
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step
            losses = fabric.all_gather(loss.detach())
            if fabric.global_rank == 0:
                record = {"step": step, "losses": [value.hex() for value in losses.tolist()], "resumed_from": resumed_from}
                with open(out / "losses.jsonl", "a") as file:
                    file.write(json.dumps(record) + "\n")
            if step % config["save_every"] == 0:
                state["epoch"] = epoch
                # every rank saves (rank 0 writes the file); rank 0 hands its folder to Ray as the checkpoint
                with tempfile.TemporaryDirectory() as folder:
                    fabric.save(Path(folder) / STATE_FILE, state)
                    saved = ray.train.Checkpoint.from_directory(folder) if fabric.global_rank == 0 else None
                    ray.train.report({"step": step, "loss": loss.item()}, checkpoint=saved)
        state["epoch"] = epoch + 1  # a checkpoint saved at the epoch's last step resumes at the next epoch's start

    if fabric.global_rank == 0:
        torch.save({name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, out / "final.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for Ray's results, the losses and the final weights")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=5, help="report a checkpoint every N steps")
    parser.add_argument("--fail-at", type=int, default=0, help="worker 1 SIGKILLs itself at this step, once (0: never)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "out": str(out)}
    ray.init(num_cpus=args.workers, include_dashboard=False)
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.accelerator != "cpu"),
            run_config=RunConfig(name="fabric", storage_path=str(out / "ray_results"), failure_config=FailureConfig(max_failures=1)),
        )
        result = trainer.fit()
        print(f"done: last checkpoint {result.checkpoint}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
