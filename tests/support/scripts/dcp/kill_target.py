"""One rank of a job that saves a sharded checkpoint (64 MB) over and over until the test SIGKILLs it.

Save number S fills every parameter with S and stores ``step=S``, so whatever loads afterwards can
tell whether the folder is one whole checkpoint (parameters equal to its step) or a mix.
``kill_target.py OUT [async]``: with ``async`` the saves are asynchronous (the kill lands in the
background write).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fabric.checkpoint.formats.sharded import save_sharded


def main() -> None:
    out, use_async = Path(sys.argv[1]), sys.argv[2:] == ["async"]
    dist.init_process_group("gloo")
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    for step in range(1, 10_000):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(step))
        save_sharded(out / "ckpt", {"model": model, "step": step}, async_save=use_async)


if __name__ == "__main__":
    main()
