"""A program written for Lightning Fabric, with its one import changed: it trains, saves to the URL it is given
(``memory://``, ``s3://``), loads the checkpoint into fresh objects and checks it is what it saved.

    python lightning_program.py URL DEVICES
"""

import sys

import torch
from torch import nn

from fabric import Fabric  # the program's only change: was `from lightning.fabric import Fabric`


def build(fabric: Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return fabric.setup(model, optimizer)


def main(url: str, devices: int) -> None:
    fabric = Fabric(accelerator="cpu", devices=devices)
    fabric.launch()
    fabric.seed_everything(7)
    model, optimizer = build(fabric)
    for _ in range(3):
        loss = model(torch.randn(4, 8, device=fabric.device)).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    fabric.save(url, {"model": model, "optimizer": optimizer, "step": 3})
    fabric.barrier()

    fresh_model, fresh_optimizer = build(fabric)
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    remainder = fabric.load(url, state)
    assert remainder == {} and state["step"] == 3, (remainder, state["step"])
    for saved, loaded in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(saved, loaded)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], fresh_optimizer.state_dict()["state"][0]["exp_avg"])

    weights_url = url + ".weights"
    fabric.save(weights_url, model.state_dict())  # a plain state dict, as torch.save would write it
    raw = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fabric.load_raw(weights_url, raw)  # the model's state dict, into a plain module
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), raw.parameters()))
    print(f"rank {fabric.global_rank}: loaded step {state['step']} from {url}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
