"""A bounded load generator for measuring on a busy machine: CPU spinners and a disk writer, for a fixed time.

    python benchmarks/busy.py --seconds 120 [--cpu N] [--io 1] [--dir DIR] &
    python benchmarks/checkpoint.py ...

Each CPU worker spins in pure Python; each IO worker writes 64 MB files with fsync into DIR (and
deletes them), the kind of traffic other jobs put on a shared disk. Everything stops after
``--seconds`` and the files are removed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time


def _spin(until: float) -> None:
    while time.monotonic() < until:
        sum(range(10_000))


def _write(until: float, folder: str) -> None:
    block = os.urandom(1 << 20)
    path = os.path.join(folder, f"busy-{os.getpid()}.bin")
    try:
        while time.monotonic() < until:
            with open(path, "wb") as file:
                for _ in range(64):
                    file.write(block)
                file.flush()
                os.fsync(file.fileno())
    finally:
        if os.path.exists(path):
            os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--cpu", type=int, default=os.cpu_count() or 1, help="spinning processes")
    parser.add_argument("--io", type=int, default=1, help="writing processes")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    until = time.monotonic() + args.seconds
    folder = args.dir or tempfile.gettempdir()
    workers = [mp.Process(target=_spin, args=(until,)) for _ in range(args.cpu)]
    workers += [mp.Process(target=_write, args=(until, folder)) for _ in range(args.io)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()
