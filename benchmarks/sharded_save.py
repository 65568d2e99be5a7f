"""What a sharded ``save_sharded`` costs compared with a raw ``torch.distributed.checkpoint.save``.

A real N-process gloo job on this machine: every rank holds its shards of a ``fully_shard``-ed model
and its AdamW state (about ``--size-mb`` MB of parameters in total, three times that with the
optimizer state), and saves, in a new random order each repetition, with

* ``raw dcp.save``      -- ``dcp.save({"model": ..., "optimizer": ...})`` of torch's state dicts into
                           a folder, overwritten in place (not atomic; what a raw script writes);
* ``save_sharded``      -- ours: temp folder, shards + objects file, fsync, publication by renames;
* ``save_sharded async``-- ours with ``async_save=True``: the time the loop is blocked (copy to CPU
                           memory); the background write is then waited for outside the timing.

Both sync variants fsync their files (torch's writer does by default). Medians over repetitions,
as rank 0 measures them (all ranks start each save together after a barrier).

    python benchmarks/sharded_save.py [--world-size 2] [--size-mb 64] [--reps 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fabric.checkpoint.formats.sharded import save_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    width = 1024
    layers = max(1, int(args.size_mb * 2**20 / (4 * width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    base = Path(args.dir)

    def raw() -> None:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=base / "raw")

    def ours() -> None:
        save_sharded(base / "ours", {"model": model, "optimizer": optimizer, "step": 1})

    handles = []

    def ours_async() -> None:
        handles.append(save_sharded(base / "ours-async", {"model": model, "optimizer": optimizer, "step": 1}, async_save=True))

    variants = {"raw dcp.save": raw, "save_sharded": ours, "save_sharded async (blocked)": ours_async}
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        random.Random(rep).shuffle(order)
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            variants[name]()
            elapsed = time.perf_counter() - start
            if handles:
                handles.pop().wait()
            if rep > 0:
                times[name].append(elapsed)
    if rank == 0:
        total_mb = sum(p.numel() * 4 for p in model.parameters()) * 3 / dist.get_world_size() / 2**20
        med = {name: statistics.median(values) for name, values in times.items()}
        print(f"{dist.get_world_size()} processes, {layers} layers of {width}x{width}; per rank ~{total_mb:.0f} MB"
              f" (params + AdamW state); median of {args.reps} reps")
        for name, value in med.items():
            print(f"  {name:30s} {value * 1000:8.1f} ms   (min {min(times[name]) * 1000:.1f} ms)")
        print(f"  save_sharded / raw dcp.save          = {med['save_sharded'] / med['raw dcp.save']:.3f}x (goal <= 1.05)")
        blocked = med["save_sharded async (blocked)"] / med["save_sharded"]
        print(f"  async blocked / sync save_sharded    = {blocked:.3f}x (goal <= 0.25)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--size-mb", type=float, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        rank_main(args)
        return
    folder = Path(args.dir or tempfile.mkdtemp(prefix="fabric-sharded-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.world_size),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, __file__, "--rank-process", "--size-mb", str(args.size_mb), "--reps", str(args.reps),
               "--dir", str(folder)]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.world_size)]
    try:
        codes = [proc.wait(timeout=1800) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    raise SystemExit(max(codes))


if __name__ == "__main__":
    main()
