"""What an atomic, durable ``fabric.save`` costs compared with a plain ``torch.save``.

``torch.save(state, path)`` overwrites the file in place: fast, but a crash mid-write leaves a torn
checkpoint, and nothing is on disk until the kernel gets round to it. ``fabric.save`` writes a
temporary file, makes it durable, and renames it over the old one. This measures the price, on a
~200 MB state (a model's worth of float32 tensors), with every variant run in the same process, in a
new random order each time, several times; we compare medians.

Also measured, to show where the time goes and what each idea buys (all of them atomic):

* ``fsync, no overlap``        -- the textbook recipe: torch.save to a temp file, fsync, rename.
* ``fdatasync, no overlap``    -- same, fdatasync (skips metadata not needed to read the data).
* ``C++ writer + fdatasync``   -- torch.save to the temp *path* (torch's own C++ file writer).
* ``torch.save + fsync``       -- durable but not atomic, for reference.

``fabric.save`` = temp file + writeback started during serialization (``sync_file_range``) +
``fdatasync`` + rename + folder fsync; the row below it switches the early writeback off. Its
"sync share" is the time spent waiting in fsync/fdatasync.

On a busy machine single saves vary by 2x or more; the medians of many reps, and the minimums (the
best case, nearest to a quiet machine), are both printed.

    python benchmarks/checkpoint.py [--size-mb 200] [--reps 15] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from fabric import Fabric
from fabric.checkpoint.storage import disk as fabric_io

GOAL = 1.10


class SyncClock:
    """Adds up the time spent in os.fsync / os.fdatasync (patched in this process only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._fsync, self._fdatasync = os.fsync, getattr(os, "fdatasync", os.fsync)

    def __enter__(self) -> SyncClock:
        def timed(function: Callable[[int], None]) -> Callable[[int], None]:
            def call(fd: int) -> None:
                start = time.perf_counter()
                try:
                    function(fd)
                finally:
                    self.seconds += time.perf_counter() - start

            return call

        os.fsync = timed(self._fsync)
        if hasattr(os, "fdatasync"):
            os.fdatasync = timed(self._fdatasync)
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync = self._fsync
        if hasattr(os, "fdatasync"):
            os.fdatasync = self._fdatasync


def make_state(size_mb: int) -> dict:
    """A model-like state: float32 tensors of a few sizes, ``size_mb`` MB in all."""
    generator = torch.Generator().manual_seed(0)
    numel = size_mb * (1 << 20) // 4
    sizes = [numel // 4, numel // 4, numel // 8, numel // 8, numel // 8]
    sizes.append(numel - sum(sizes))
    model = {f"layer{i}.weight": torch.randn(n, generator=generator) for i, n in enumerate(sizes)}
    return {"model": model, "step": 1234, "config": {"lr": 0.1, "name": "bench"}}


def _fsync_path(path: str, data_only: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        (os.fdatasync if data_only and hasattr(os, "fdatasync") else os.fsync)(fd)
    finally:
        os.close(fd)


def _replace_durably(temp: str, path: str) -> None:
    os.replace(temp, path)
    _fsync_path(os.path.dirname(path))


def variants(folder: Path, state: dict) -> dict[str, Callable[[], None]]:
    fabric = Fabric(accelerator="cpu", devices=1)

    def torch_save() -> None:
        torch.save(state, str(folder / "torch.pt"))

    def fabric_save() -> None:
        fabric.save(folder / "fabric.pt", state)

    def fsync_no_overlap() -> None:
        path = str(folder / "fsync.pt")
        with open(path + ".tmp", "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        _replace_durably(path + ".tmp", path)

    def fdatasync_no_overlap() -> None:
        path = str(folder / "fdatasync.pt")
        with open(path + ".tmp", "wb", buffering=1 << 20) as file:
            torch.save(state, file)
            file.flush()
            os.fdatasync(file.fileno())
        _replace_durably(path + ".tmp", path)

    def cpp_writer() -> None:
        path = str(folder / "cpp.pt")
        torch.save(state, path + ".tmp")
        _fsync_path(path + ".tmp", data_only=True)
        _replace_durably(path + ".tmp", path)

    def without_early_writeback() -> None:
        chunk = fabric_io._WRITEBACK_CHUNK
        fabric_io._WRITEBACK_CHUNK = 1 << 62
        try:
            fabric.save(folder / "no_overlap.pt", state)
        finally:
            fabric_io._WRITEBACK_CHUNK = chunk

    def torch_save_fsync() -> None:
        path = str(folder / "torch_fsync.pt")
        torch.save(state, path)
        _fsync_path(path)

    return {
        "torch.save": torch_save,
        "fabric.save": fabric_save,
        "  without early writeback": without_early_writeback,
        "fsync, no overlap": fsync_no_overlap,
        "fdatasync, no overlap": fdatasync_no_overlap,
        "C++ writer + fdatasync": cpp_writer,
        "torch.save + fsync": torch_save_fsync,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder in the system temp dir)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="fabric-ckpt-bench-", dir=args.dir))
    try:
        state = make_state(args.size_mb)
        runs = variants(folder, state)
        times: dict[str, list[float]] = {name: [] for name in runs}
        syncs: list[float] = []
        names = list(runs)
        for name in names:  # warm-up: first allocation of each file, imports, page cache
            runs[name]()
        shuffler = random.Random(0)
        for _rep in range(args.reps):
            order = list(names)
            shuffler.shuffle(order)  # a new order each rep: no variant always follows the same one
            for name in order:
                with SyncClock() as clock:
                    start = time.perf_counter()
                    runs[name]()
                    elapsed = time.perf_counter() - start
                times[name].append(elapsed)
                if name == "fabric.save":
                    syncs.append(clock.seconds)
        size = os.path.getsize(folder / "fabric.pt") / 1e6
        base = statistics.median(times["torch.save"])
        print(f"checkpoint of {size:.0f} MB, {args.reps} reps, medians; folder {folder.parent} ({_filesystem(folder)})")
        print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, writeback overlap:"
              f" {'yes (sync_file_range)' if fabric_io._sync_file_range() else 'no (not Linux)'}")
        print(f"{'variant (all but the first and last are atomic)':48s} {'median':>8s} {'min':>8s} {'vs torch.save':>14s}")
        for name in names:
            median = statistics.median(times[name])
            print(f"{name:48s} {median:7.3f}s {min(times[name]):7.3f}s {median / base:13.2f}x")
        fabric_median = statistics.median(times["fabric.save"])
        sync_median = statistics.median(syncs)
        print(f"fabric.save waits in fsync/fdatasync: {sync_median:.3f}s median ({sync_median / fabric_median:.0%} of its time)")
        ratio = fabric_median / base
        best = min(times["fabric.save"]) / min(times["torch.save"])
        print(f"fabric.save / torch.save = {ratio:.2f}x of medians, {best:.2f}x of minimums"
              f" (goal <= {GOAL:.2f}x): {'met' if ratio <= GOAL else 'NOT met'}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _filesystem(folder: Path) -> str:
    """The filesystem type of ``folder`` (from /proc/mounts), for the record."""
    try:
        best = ("", "?")
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) > 2 and str(folder).startswith(parts[1]) and len(parts[1]) >= len(best[0]):
                    best = (parts[1], parts[2])
        return best[1]
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
