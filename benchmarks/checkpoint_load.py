"""What a checked ``fabric.load`` costs compared with a plain load, for a single file and a folder of shards.

``fabric.load`` checks before it changes anything: every record's CRC-32 (taken as the bytes are read,
in the same pass), the keys and shapes of every entry, and, for a folder of shards, it reads into new
storage so a failed read changes nothing (one extra copy of the loaded state in memory while it runs).
This measures the price against what a raw script does, in the same process, in a new random order
each repetition:

* file, ``torch.load + load_state_dict``  -- the raw single-file load;
* file, ``fabric.load``                   -- ours (CRC, fit checks, then the same copies);
* folder, ``dcp.load in place``           -- the raw sharded load: torch.distributed.checkpoint reading
                                             straight into the model's and optimizer's tensors;
* folder, ``load_sharded``                -- ours (index and file-size checks, CRC of every item, reads
                                             into new storage, then the model's tensors copied in).

One process; the file is ``--size-mb`` of parameters, the folder the same model with its Adam state.
Files are in the page cache after the first repetition, so this is the CPU cost of the checks, the
part that a faster disk does not hide. ``--cold`` evicts this run's own files from the page cache
before every load (``posix_fadvise(DONTNEED)``, no root needed, nothing else evicted), so they come
from the disk. Medians and minimums over repetitions, and the minor page faults of each load. On a
machine whose cores other jobs use, ``--threads 1`` keeps torch's copies from waiting for a second
core (its intra-op threads spin at barriers), which otherwise swings single loads by 2-5x.

Fresh memory costs page faults, and glibc decides whether a load gets fresh memory or memory freed by
the previous one (its thresholds move with what was freed), so single loads vary by tens of percent.
``--malloc reuse`` fixes glibc's thresholds high for this run (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``): freed memory is kept and reused, loads after the untimed ones rarely
fault, and what is left is the CPU work of each variant. ``--malloc default`` (the default) is what a program gets. ``--first-load``
times every load as the first of a new process that has just built the model and a fresh optimizer
(untimed), as when a job resumes: no memory freed by an earlier load is there to reuse, and the
optimizer has no state yet (both sides allocate it: torch's state-dict API creates it before loading).

    python benchmarks/checkpoint_load.py [--size-mb 200] [--reps 9] [--dir DIR] [--cold] [--malloc reuse] [--threads 1] [--first-load]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

# glibc ignores an mmap threshold over 32 MiB (its maximum on 64-bit): 32 MiB keeps every item of 4 MiB on the heap
_REUSE = {"MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_MMAP_THRESHOLD_": str(2**25), "MALLOC_TOP_PAD_": "0"}


def model_of(size_mb: int) -> nn.Module:
    width = 1024
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def evict(root: Path) -> None:
    """Drop this run's files (and only them) from the page cache: the next read comes from the disk."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def state_of(size_mb: int, stepped: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its Adam optimizer, after one step (so the optimizer holds state), or as a resumed job
    makes them before it loads (``stepped=False``: no optimizer state yet)."""
    torch.manual_seed(0)
    model = model_of(size_mb)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if stepped:
        model(torch.randn(2, 1024)).sum().backward()
        optimizer.step()
    return model, optimizer


def write_checkpoints(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The single file and the folder of shards (ours), and the folder a raw ``dcp.save`` writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from fabric import Fabric
    from fabric.checkpoint.sharded_folder import save_sharded

    Fabric(accelerator="cpu", devices=1).save(root / "model.pt", {"model": model})
    save_sharded(root / "sharded", {"model": model, "optimizer": optimizer})
    raw_state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(raw_state, checkpoint_id=root / "raw", no_dist=True)


def variants_for(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Callable[[], None]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fabric import Fabric
    from fabric.checkpoint.sharded_folder import load_sharded

    fabric = Fabric(accelerator="cpu", devices=1)
    file, folder = root / "model.pt", root / "sharded"

    def raw_file() -> None:
        model.load_state_dict(torch.load(file, weights_only=True)["model"])

    def ours_file() -> None:
        fabric.load(file, {"model": model})

    def raw_folder() -> None:  # torch's recipe: state dicts of the live objects, loaded in place, set back
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=root / "raw", no_dist=True)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    def ours_folder() -> None:
        load_sharded(folder, {"model": model, "optimizer": optimizer})

    return {
        "file: torch.load + load_state_dict": raw_file,
        "file: fabric.load": ours_file,
        "folder: dcp.load in place": raw_folder,
        "folder: load_sharded": ours_folder,
    }


def timed(load: Callable[[], None]) -> tuple[float, int]:
    """Seconds and minor page faults of one load."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    load()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--cold", action="store_true", help="evict the checkpoint files from the page cache before every load")
    parser.add_argument("--malloc", choices=["default", "reuse"], default="default", help="glibc's thresholds (see above)")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--first-load", action="store_true", help="time each load as the first one of a new process")
    parser.add_argument("--child", nargs=2, metavar=("ROOT", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc == "reuse" and any(os.environ.get(name) != value for name, value in _REUSE.items()):
        # glibc reads these when the process starts: run again with them set
        sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, **_REUSE}))
    if args.child:  # one load, the first of this process: print its milliseconds and page faults
        root, name = Path(args.child[0]), args.child[1]
        seconds, faults = timed(variants_for(root, *state_of(args.size_mb, stepped=False))[name])
        print(f"{seconds} {faults}")
        return

    root = Path(tempfile.mkdtemp(prefix="load-bench-", dir=args.dir))
    model, optimizer = state_of(args.size_mb)
    write_checkpoints(root, model, optimizer)
    variants = variants_for(root, model, optimizer)
    if not args.first_load:
        for variant in [*variants.values()] * 2:  # twice each, untimed: first-call costs (imports, caches), and
            variant()  # the heap grown to what a load holds at its peak (ours: the old state and the new)
    else:
        del model, optimizer, variants  # the children load; this process only keeps the files
    names = ["file: torch.load + load_state_dict", "file: fabric.load", "folder: dcp.load in place", "folder: load_sharded"]
    times: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}
    for _ in range(args.reps):
        order = list(names)
        random.shuffle(order)
        for name in order:
            if args.cold:
                evict(root)
            if args.first_load:
                command = [sys.executable, __file__, "--child", str(root), name, "--size-mb", str(args.size_mb)]
                output = subprocess.run(command + (["--threads", str(args.threads)] if args.threads else []), capture_output=True, text=True, check=True)
                seconds, count = output.stdout.split()[-2:]
                took, faulted = float(seconds), int(count)
            else:
                took, faulted = timed(variants[name])
            times[name].append(took)
            faults[name].append(faulted)
    shutil.rmtree(root)
    where = "cold (evicted from the page cache)" if args.cold else "page cache"
    print(
        f"{args.size_mb} MB of parameters, {args.reps} repetitions, {where}, malloc {args.malloc},"
        f" {args.threads or torch.get_num_threads()} thread(s){', first load of a process' if args.first_load else ''}, torch {torch.__version__}"
    )
    print(f"{'variant':44s} {'median ms':>10s} {'min ms':>8s} {'faults':>8s}")
    for name, values in times.items():
        print(f"{name:44s} {statistics.median(values) * 1000:10.1f} {min(values) * 1000:8.1f} {statistics.median(faults[name]):8.0f}")

    def ratio(ours: str, raw: str, pick: Callable[[list[float]], float]) -> float:
        return pick(times[ours]) / pick(times[raw])

    file_pair = ("file: fabric.load", "file: torch.load + load_state_dict")
    folder_pair = ("folder: load_sharded", "folder: dcp.load in place")
    print(
        f"fabric.load / raw file load: {ratio(*file_pair, statistics.median):.2f}x (minimums {ratio(*file_pair, min):.2f}x);"
        f" load_sharded / dcp.load in place: {ratio(*folder_pair, statistics.median):.2f}x (minimums {ratio(*folder_pair, min):.2f}x)"
    )


if __name__ == "__main__":
    main()
