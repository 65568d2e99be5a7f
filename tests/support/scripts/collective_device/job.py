"""One rank of a 2-process gloo job (started by torchrun-like variables) checking where collectives get their tensors.

Stand-in for a GPU job: NCCL serves only the rank's GPU, so a tensor made elsewhere (a model built in
host memory) must reach the root device before any collective. Here the root device is the CPU and the
"elsewhere" is torch's lazy device, which a CPU build has; the device guard (support/device_guard.py)
refuses what NCCL would refuse. Writes ``<out>/<rank>.json``.

Modes:
  broadcast   rank 0's weights of a module made on the lazy device, sent with fabric's set-up broadcast
  collectives Fabric's and the strategy's collectives fed lazy tensors, under DDP on the CPU
  guard       a plain dist.broadcast of a lazy tensor (the guard must refuse it)
  fsdp        FSDP set-up of a module made on the CPU: how many broadcasts carry rank 0's weights
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch
import torch._lazy.ts_backend
from torch import nn

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.manual_seed(rank)  # every rank starts from different weights
torch._lazy.ts_backend.init()
LAZY = torch.device("lazy")


@dataclass(frozen=True)
class Frozen:
    name: str
    tensor: torch.Tensor


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def tensors_of(module: nn.Module) -> dict[str, list]:
    return {name: t.detach().cpu().reshape(-1).tolist() for name, t in module.state_dict().items()}


result: dict = {"rank": rank}
if mode == "guard":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        dist.broadcast(torch.ones(3, device=LAZY), src=0)
        result["refused"] = None
    except RuntimeError as err:
        result["refused"] = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
elif mode == "broadcast":
    import torch.distributed as dist

    from fabric.strategies.sharding import broadcast_module_from_rank_zero

    dist.init_process_group("gloo")
    module = model().to(LAZY)
    broadcast_module_from_rank_zero(module, torch.device("cpu"))
    result["devices"] = sorted({str(t.device) for t in module.state_dict().values()})
    result["tensors"] = tensors_of(module)
    dist.destroy_process_group()
elif mode == "collectives":
    from fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    strategy = fabric.strategy
    value = torch.tensor([float(rank + 1)], device=LAZY)
    result["all_reduce"] = strategy.all_reduce(value, reduce_op="sum").cpu().tolist()
    result["all_gather"] = strategy.all_gather(value).cpu().reshape(-1).tolist()
    result["fabric_all_reduce"] = fabric.all_reduce(value, reduce_op="mean").cpu().tolist()
    result["broadcast"] = fabric.broadcast(value.cpu() * 10, src=1).tolist()
    result["decision"] = fabric.reduce_boolean_decision(rank == 1, all=False)
    # what the checkpoint pipeline broadcasts (its outcomes) and users may: a frozen dataclass, holding a tensor
    frozen = fabric.broadcast(Frozen(str(rank), torch.full((2,), float(rank))), src=1)
    result["frozen"] = [type(frozen).__name__, frozen.name, frozen.tensor.tolist()]
    fabric.barrier()
elif mode == "fsdp":
    from fabric import Fabric
    from support.device_guard import LOG_VARIABLE

    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    fabric.launch()
    log = os.path.join(os.environ[LOG_VARIABLE], f"{os.getpid()}.log")

    def broadcasts() -> int:
        if not os.path.exists(log):
            return 0
        with open(log) as file:
            return sum(1 for line in file if line.startswith("broadcast "))

    before = broadcasts()
    module = model()
    result["tensor_count"] = len(list(module.parameters())) + len(list(module.buffers()))
    wrapped = fabric.setup_module(module)
    result["broadcasts"] = broadcasts() - before
    result["tensors"] = {name: t.full_tensor().reshape(-1).tolist() if hasattr(t, "full_tensor") else t.reshape(-1).tolist()
                         for name, t in wrapped.state_dict().items()}
else:
    raise SystemExit(f"unknown mode {mode!r}")

with open(os.path.join(out, f"{rank}.json"), "w") as file:
    json.dump(result, file)
