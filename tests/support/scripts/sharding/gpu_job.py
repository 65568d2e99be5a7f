"""The sharded strategies on a real GPU (NCCL, CUDA placement, CPU offload, bf16-mixed): ``torchrun --nproc-per-node N gpu_job.py OUT``.

Run by hand (or by CI) on a machine with CUDA; prints one line per check and exits non-zero on a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import data, full_parameters, make_net, parallelize

from fabric import Fabric
from fabric.strategies import FSDPStrategy, ModelParallelStrategy


def run(strategy, precision, out: Path, name: str) -> None:
    fabric = Fabric(accelerator="cuda", devices=int(__import__("os").environ["LOCAL_WORLD_SIZE"]), strategy=strategy, precision=precision)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = make_net()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    params = list(model.module.parameters())
    xs, ys = data(3)
    for x, y in zip(xs, ys):
        loss = F.mse_loss(model(x.to(fabric.device)), y.to(fabric.device))
        fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(out / name, {"model": model, "optimizer": optimizer, "step": 3})
    before = full_parameters(model.module)
    fabric.load(out / name, {"model": model, "optimizer": optimizer})
    after = full_parameters(model.module)
    same = all(torch.equal(before[k], after[k]) for k in before)
    print(
        f"rank {fabric.global_rank} {name}: backend={dist.get_backend()} mesh={fabric.strategy.device_mesh.device_type}"
        f" param_device={params[0].device} local_device={params[0].to_local().device} grad_norm={float(norm):.4f}"
        f" loss={float(loss):.4f} reload_equal={same}",
        flush=True,
    )
    assert same and params[0].to_local().device.type == ("cpu" if getattr(strategy, "cpu_offload", None) else "cuda")


def main() -> None:
    out = Path(sys.argv[1])
    run(FSDPStrategy(), "bf16-mixed", out, "fsdp_bf16")
    run(FSDPStrategy(), "16-mixed", out, "fsdp_fp16")  # with the precision plugin's gradient scaler
    run(FSDPStrategy(cpu_offload=True), "32-true", out, "fsdp_offload")
    run(ModelParallelStrategy(parallelize), "32-true", out, "tp")


if __name__ == "__main__":
    main()
