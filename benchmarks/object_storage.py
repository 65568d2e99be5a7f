"""What ``fabric.save`` / ``fabric.load`` of a single file on an S3 server cost compared with the raw recipe.

The raw recipe a user would write: ``torch.save(state, fsspec.open(url, "wb"))`` and
``torch.load(fsspec.open(url, "rb"))``. It has none of the guarantees: a reader can meet a torn or
half-replaced object on a store without atomic writes, damaged bytes load silently. ``fabric.save``
writes the object under a new generation, then the commit record (size, CRC-32), then removes the old
generation; ``fabric.load`` reads the record, the object (checking its size and CRC-32 against the record)
and loads it through the per-record CRC check.

The server is moto's S3 server on 127.0.0.1 (in this process's threads), so the numbers measure the
client side and the extra requests, not a network. Variants alternate in a random order; medians. Beside
the wall time, the CPU time of this process (client and server threads together): on a machine shared
with other jobs it moves far less than the wall time does.

    python benchmarks/object_storage.py [--size-mb 200] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    import fsspec
    import s3fs
    import torch
    from moto.server import ThreadedMotoServer

    from fabric import Fabric
    from support.environment import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        s3fs.S3FileSystem().mkdir("bench")
        numel = args.size_mb * 2**20 // 4
        state = {f"layer{i}": torch.randn(numel // 8) for i in range(8)}
        fabric = Fabric(accelerator="cpu", devices=1)
        raw_url, fabric_url = "s3://bench/raw.pt", "s3://bench/fabric.pt"

        def raw_save() -> None:
            with fsspec.open(raw_url, "wb") as file:
                torch.save(state, file)

        def raw_load() -> None:
            with fsspec.open(raw_url, "rb") as file:
                torch.load(file, weights_only=True)

        def fabric_save() -> None:
            fabric.save(fabric_url, state)

        def fabric_load() -> None:
            fabric.load(fabric_url)

        variants: dict[str, Callable[[], None]] = {
            "raw save": raw_save, "fabric save": fabric_save, "raw load": raw_load, "fabric load": fabric_load,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        raw_save()
        fabric_save()
        for _ in range(args.reps):
            for pair in (["raw save", "fabric save"], ["raw load", "fabric load"]):
                random.shuffle(pair)
                for name in pair:
                    cpu_before = _cpu_seconds()
                    started = time.perf_counter()
                    variants[name]()
                    times[name].append(time.perf_counter() - started)
                    cpu[name].append(_cpu_seconds() - cpu_before)
        print(f"{args.size_mb} MB single file, moto S3 server on 127.0.0.1, {args.reps} reps, medians (min):")
        for name, values in times.items():
            print(f"  {name:12s} {statistics.median(values):7.2f} s  ({min(values):.2f} s)   CPU {statistics.median(cpu[name]):6.2f} s")
        for what in ("save", "load"):
            ratio = statistics.median(times[f"fabric {what}"]) / statistics.median(times[f"raw {what}"])
            cpu_ratio = statistics.median(cpu[f"fabric {what}"]) / statistics.median(cpu[f"raw {what}"])
            print(f"  {what}: fabric / raw = {ratio:.2f}x (CPU time {cpu_ratio:.2f}x)")
    finally:
        server.stop()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
