"""What a sharded ``fabric.save`` / ``fabric.load`` (2-process FSDP) on an S3 server costs compared with the raw recipe.

The raw recipe a user would write with torch alone: ``dcp.save(state, storage_writer=FsspecWriter(url))`` and
``dcp.load(state, storage_reader=FsspecReader(url))`` (torch.distributed.checkpoint._fsspec_filesystem; state: ``get_model_state_dict``, loaded in place, then
``set_model_state_dict``), measured as written (``sync_files=True``, torch's default, which on a store calls
``os.sync()`` after each file), with ``sync_files=False``, and, for reference, with ``thread_count=4`` (four
files per rank written and uploaded at once, as fabric does; not the default a user meets). It has none of the guarantees: a reader can meet a
half-written checkpoint (torch writes the index last, but over the previous one's objects), and damaged or
mixed-in objects load silently. ``fabric.save`` writes each rank's shards into a local staging folder (up to
four files per rank, by as many threads) and uploads each file under a new generation while it is written
(digesting every byte on the way), then rank 0 writes the objects file and the commit record, and removes the
old generation; ``fabric.load`` agrees on the record, fetches the
index and objects file and then the items each rank reads (up to four files at once), each checked against its
CRC-32, and loads them with every local check.

The server is moto's S3 server on 127.0.0.1 (threads of the launching process), so the numbers measure the
client side and the extra requests, not a network. The two ranks run under torchrun; each measurement is the
slower rank's time between two barriers. Variants alternate in a random order (the same on both ranks); medians.

    python benchmarks/object_storage_sharded.py [--size-mb 200] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def launch(args: argparse.Namespace) -> None:
    """The launching process: the S3 server, a bucket, and the 2-rank job running :func:`rank`."""
    import s3fs
    from moto.server import ThreadedMotoServer

    from support.environment import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}  # fmt: skip
    os.environ.update(credentials)
    try:
        s3fs.S3FileSystem().mkdir("bench")
        env = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(credentials, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
             __file__, "--rank-side", f"--size-mb={args.size_mb}", f"--reps={args.reps}"],
            env=env, check=True,
        )  # fmt: skip
    finally:
        server.stop()


def rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fabric import Fabric
    from fabric.strategies import FSDPStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy())
    fabric.launch()
    width = 2048
    layers = max(1, args.size_mb * 2**20 // (width * width * 4))
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]))
    size_mb = sum(param.numel() for param in model.parameters()) * 4 / 2**20  # the whole model: both ranks' shards
    url = "s3://bench/sharded"

    def raw_save(sync_files: bool, thread_count: int = 1) -> Callable[[], None]:
        def save() -> None:
            writer = FsspecWriter(f"{url}-raw", sync_files=sync_files, thread_count=thread_count)
            dcp.save(get_model_state_dict(model.module), storage_writer=writer)

        return save

    def raw_load() -> None:
        state = get_model_state_dict(model.module)
        dcp.load(state, storage_reader=FsspecReader(f"{url}-raw"))
        set_model_state_dict(model.module, state)

    def fabric_save() -> None:
        fabric.save(f"{url}-fabric", {"model": model})

    def fabric_load() -> None:
        fabric.load(f"{url}-fabric", {"model": model})

    variants: dict[str, Callable[[], None]] = {
        "raw save": raw_save(True), "raw save (sync_files=False)": raw_save(False),
        "raw save (4 threads, no sync)": raw_save(False, 4), "fabric save": fabric_save,
        "raw load": raw_load, "fabric load": fabric_load,
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in variants}
    raw_save(False)()
    fabric_save()
    for rep in range(args.reps):
        order = random.Random(rep)  # the same order on both ranks
        saves = ["raw save", "raw save (sync_files=False)", "raw save (4 threads, no sync)", "fabric save"]
        for group in (saves, ["raw load", "fabric load"]):
            order.shuffle(group)
            for name in group:
                dist.barrier()
                started = time.perf_counter()
                variants[name]()
                elapsed = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job waits for its slower rank
                times[name].append(float(elapsed))
    if fabric.global_rank == 0:
        print(f"{size_mb:.0f} MB model, 2-process FSDP (sharded), moto S3 server on 127.0.0.1, {args.reps} reps, medians (min):")
        for name, values in times.items():
            print(f"  {name:30s} {statistics.median(values):7.2f} s  ({min(values):.2f} s)")
        for what, raws in (("save", ["raw save", "raw save (sync_files=False)", "raw save (4 threads, no sync)"]), ("load", ["raw load"])):
            for raw in raws:
                ratio = statistics.median(times[f"fabric {what}"]) / statistics.median(times[raw])
                print(f"  fabric {what} / {raw} = {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
