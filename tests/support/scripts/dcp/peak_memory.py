"""How much a resumed job's sharded load raises the process's peak memory, ours against torch's recipe.

``peak_memory.py FOLDER save``: train a 64 MiB model one Adam step; write it with ``save_sharded``
(``FOLDER/ours``) and with a raw ``dcp.save`` of torch's distributed state dicts (``FOLDER/raw``).
``peak_memory.py FOLDER ours|raw``: as a resumed job does, build the model and a fresh optimizer, then
load: ``load_sharded``, or torch's in-place recipe (state dicts of the live objects, ``dcp.load`` into
them, set back). Prints how far the load raised the peak resident memory, in bytes; each in a process
of its own, after a first tiny load of the same kind, so that imports and first-call costs are not
counted.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.sharded import save_sharded
from support.memory import peak_resident_bytes

MODEL_BYTES = 4 * 2048 * 2048 * 4


def build(layers: int = 4, width: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters())


def stepped(layers: int = 4, width: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = build(layers, width)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def raw_load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def save(folder: Path) -> None:
    for name, (model, optimizer) in (("", stepped()), ("tiny-", stepped(1, 4))):
        save_sharded(folder / f"{name}ours", {"model": model, "optimizer": optimizer})
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=folder / f"{name}raw", no_dist=True)


def main() -> None:
    folder, mode = Path(sys.argv[1]), sys.argv[2]
    warnings.simplefilter("ignore")  # dcp's "assuming a single process"
    torch.set_num_threads(1)
    if mode == "save":
        save(folder)
        return

    def load(source: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if mode == "ours":
            load_sharded(source, {"model": model, "optimizer": optimizer})
        else:
            raw_load(source, model, optimizer)

    load(folder / f"tiny-{mode}", *build(1, 4))
    model, optimizer = build()
    before = peak_resident_bytes()
    load(folder / mode, model, optimizer)
    print(peak_resident_bytes() - before)


if __name__ == "__main__":
    main()
