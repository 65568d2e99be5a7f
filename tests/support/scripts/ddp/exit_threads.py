"""A two-rank popen job written as many scripts are: the model and Fabric live at module level.

``exit_threads.py OUTDIR [ddp|fsdp|tensor_parallel]``: the strategy the job runs under (default ddp).
The sharded ones leave DTensor's caches holding their device meshes for the life of the process.

An exit hook registered before Fabric exists runs after Fabric's own, at the last moment the
interpreter is whole; it writes the names of the threads still running to ``<outdir>/threads<R>.json``.
gloo's threads still alive there can abort the process during shutdown (exit 134).
"""

import atexit
import json
import os
import sys
from pathlib import Path

OUTDIR = Path(sys.argv[1])
STRATEGY = sys.argv[2] if len(sys.argv) > 2 else "ddp"


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # ended meanwhile
            pass
    return sorted(names)


atexit.register(lambda: (OUTDIR / f"threads{os.environ.get('RANK', '0')}.json").write_text(json.dumps(_thread_names())))

import torch  # noqa: E402

from fabric import Fabric  # noqa: E402
from fabric.strategies import ModelParallelStrategy  # noqa: E402


def _tensor_parallel(module: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(module, mesh["tensor_parallel"], ColwiseParallel())


strategies = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    "tensor_parallel": ModelParallelStrategy(_tensor_parallel, data_parallel_size=1, tensor_parallel_size=2),
}
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategies[STRATEGY])
fabric.launch()
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
for _ in range(3):
    fabric.backward(model(torch.randn(8, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
total = fabric.all_reduce(torch.ones(2), reduce_op="sum")
assert total.tolist() == [2.0, 2.0]
fabric.barrier()
