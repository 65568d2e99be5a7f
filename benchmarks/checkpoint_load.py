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
* folder, ``load_sharded, no binding check`` -- ours on a copy of the folder without the record that binds
                                             its data files to the save: the cost of that check, by difference.

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

``--staged-on-cpu`` adds ``fabric.load`` through the staged path (``fabric/checkpoint/formats/device_load.py``) with
the CPU as its device, to compare it with the direct read the CPU keeps.

``--device cuda``: a model of ``--size-mb`` MiB of parameters on the GPU (default 368: 96M parameters, with
AdamW's state a 1.16 GB file), saved by ``fabric.save``, then loaded (model and optimizer) by

* ``torch.load(map_location=cuda) + load_state_dict`` -- raw, the storages read to the CPU and copied to the GPU by torch.load;
* ``torch.load(map_location=cpu) + load_state_dict``  -- raw, copied to the GPU by ``load_state_dict``;
* ``fabric.load``                                     -- ours: read, CRC and host-to-device copy overlapping;
* ``fabric.load, CPU path``                           -- ours as it loads into a CPU model (read to the CPU, CRC,
                                                         then ``load_state_dict``), for comparison.

The faster raw recipe (by median) is the reference of the ratio. Without a CUDA device it exits with
status 2 and says so. ``--json PATH`` writes the results (medians, minimums, ratios, sizes, the device's
name, torch's version) as JSON, for either device.

    python benchmarks/checkpoint_load.py --device cuda [--size-mb 368] [--reps 7] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
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
    from fabric.checkpoint.formats.sharded import save_sharded

    Fabric(accelerator="cpu", devices=1).save(root / "model.pt", {"model": model})
    save_sharded(root / "sharded", {"model": model, "optimizer": optimizer})
    unbound(root / "sharded", root / "sharded-unbound")
    raw_state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(raw_state, checkpoint_id=root / "raw", no_dist=True)


def unbound(folder: Path, copy: Path) -> None:
    """A copy of ``folder`` whose objects file lacks the record binding its data files to the save (as a folder
    saved before it existed): loading it skips that check and nothing else, so it times the load without it."""
    from fabric.checkpoint.formats.shard_reader import OBJECTS_FILE
    from fabric.plugins.io import atomic_save

    shutil.copytree(folder, copy)
    objects = torch.load(copy / OBJECTS_FILE, weights_only=True)
    for key in ("save_id", "data_files"):
        objects.pop(key, None)
    atomic_save(objects, copy / OBJECTS_FILE)


def variants_for(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Callable[[], None]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fabric import Fabric
    from fabric.checkpoint.formats import load_sharded

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

    def ours_folder_unbound() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (said once: saved before the binding was recorded)
            load_sharded(root / "sharded-unbound", {"model": model, "optimizer": optimizer})

    return {
        "file: torch.load + load_state_dict": raw_file,
        "file: fabric.load": ours_file,
        "folder: dcp.load in place": raw_folder,
        "folder: load_sharded": ours_folder,
        "folder: load_sharded, no binding check": ours_folder_unbound,
        "file: fabric.load, staged on the CPU": lambda: staged_on_cpu(ours_file),
    }


def staged_on_cpu(load: Callable[[], None]) -> None:
    """``load()`` with a load into CPU objects taking the staged path, the CPU as its device."""
    from fabric.checkpoint.formats import device_load
    from fabric.checkpoint.formats import file as single_file

    choose, staging_for = single_file.staging_device, device_load.staging_for
    single_file.staging_device = lambda objects: torch.device("cpu")  # type: ignore[assignment]
    device_load.staging_for = lambda device: device_load.HostStaging()  # type: ignore[assignment]
    try:
        load()
    finally:
        single_file.staging_device, device_load.staging_for = choose, staging_for  # type: ignore[assignment]


def cpu_path(load: Callable[[], None]) -> None:
    """``load()`` with a load into GPU objects taking the CPU path (as before the staged path existed)."""
    from fabric.checkpoint.formats import device_load

    staging_for = device_load.staging_for
    device_load.staging_for = lambda device: None  # type: ignore[assignment]
    try:
        load()
    finally:
        device_load.staging_for = staging_for  # type: ignore[assignment]


GPU_RAW = "torch.load(map_location=cuda) + load_state_dict"
GPU_RAW_CPU = "torch.load(map_location=cpu) + load_state_dict"
GPU_OURS = "fabric.load"
GPU_OURS_CPU_PATH = "fabric.load, CPU path"


def main_cuda(args: argparse.Namespace) -> int:
    """The load into a model and its AdamW state on the GPU (see the module docstring); the exit status."""
    if not torch.cuda.is_available():
        print(
            f"checkpoint_load.py --device cuda: no CUDA device found (torch {torch.__version__}, built for CUDA"
            f" {torch.version.cuda}); nothing was measured",
            file=sys.stderr,
        )
        return 2
    if args.first_load or args.cold or args.malloc != "default":
        print("checkpoint_load.py --device cuda: --first-load, --cold and --malloc are for --device cpu", file=sys.stderr)
        return 2
    from fabric import Fabric

    size_mb = args.size_mb or 368
    reps = args.reps or 7
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = model_of(size_mb).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024, device=device)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    fabric = Fabric(accelerator="cuda", devices=1)
    root = Path(tempfile.mkdtemp(prefix="load-bench-", dir=args.dir))
    path = root / "ckpt.pt"
    try:
        fabric.save(path, {"model": model, "optimizer": optimizer})
        file_bytes = path.stat().st_size

        def raw(where: torch.device | str) -> Callable[[], None]:
            def load() -> None:
                checkpoint = torch.load(path, map_location=where, weights_only=True)
                model.load_state_dict(checkpoint["model"])
                optimizer.load_state_dict(checkpoint["optimizer"])

            return load

        def ours() -> None:
            fabric.load(path, {"model": model, "optimizer": optimizer})

        variants = {GPU_RAW: raw(device), GPU_RAW_CPU: raw("cpu"), GPU_OURS: ours, GPU_OURS_CPU_PATH: lambda: cpu_path(ours)}
        staged_bytes = bytes_through_the_ring(ours)  # untimed: did the staged path take the file (no fallback)?

        def timed_gpu(load: Callable[[], None]) -> tuple[float, int]:
            """Seconds (every copy to the GPU done) and minor page faults of one load."""
            torch.cuda.synchronize(device)
            return timed(lambda: (load(), torch.cuda.synchronize(device))[0])

        for variant in variants.values():  # once each, untimed: first-call costs (pinned buffers, CUDA's caches)
            timed_gpu(variant)
        times: dict[str, list[float]] = {name: [] for name in variants}
        faults: dict[str, list[int]] = {name: [] for name in variants}
        for _ in range(reps):
            order = list(variants)
            random.shuffle(order)
            for name in order:
                took, faulted = timed_gpu(variants[name])
                times[name].append(took)
                faults[name].append(faulted)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    name = torch.cuda.get_device_name(device)
    params = sum(param.numel() for param in model.parameters())
    print(
        f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda}): {params / 1e6:.1f}M parameters + AdamW,"
        f" a {file_bytes / 1e9:.2f} GB file, {reps} repetitions, page cache"
    )
    print(f"{'variant':50s} {'median ms':>10s} {'min ms':>8s} {'faults':>8s}")
    medians = {key: statistics.median(values) * 1000 for key, values in times.items()}
    minimums = {key: min(values) * 1000 for key, values in times.items()}
    for key in variants:
        print(f"{key:50s} {medians[key]:10.1f} {minimums[key]:8.1f} {statistics.median(faults[key]):8.0f}")
    reference = min((GPU_RAW, GPU_RAW_CPU), key=lambda key: medians[key])
    ratio = medians[GPU_OURS] / medians[reference]
    ratio_min = minimums[GPU_OURS] / min(minimums[GPU_RAW], minimums[GPU_RAW_CPU])
    before = medians[GPU_OURS_CPU_PATH] / medians[reference]
    print(f"bytes fabric.load copied through the ring of pinned buffers: {staged_bytes} of a {file_bytes}-byte file")
    print(
        f"fabric.load / {reference}: {ratio:.3f}x (minimums {ratio_min:.3f}x; the CPU path: {before:.3f}x);"
        f" goal <= 1.00x: {'met' if ratio <= 1.0 else 'NOT met'}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "checkpoint_load",
                "device": "cuda",
                "device_name": name,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "parameters": params,
                "file_bytes": file_bytes,
                "reps": reps,
                "median_ms": medians,
                "min_ms": minimums,
                "raw_reference": reference,
                "ratio": ratio,
                "ratio_min": ratio_min,
                "ratio_cpu_path": before,
                "staged_bytes": staged_bytes,
                "goal": 1.0,
                "met": ratio <= 1.0,
            },
        )
    return 0


def bytes_through_the_ring(load: Callable[[], None]) -> int:
    """How many bytes ``load()`` copied through the staged path's ring (0: it read to the CPU instead)."""
    from fabric.checkpoint.formats import device_load

    copied = [0]
    staging_for = device_load.staging_for

    def counting(device: torch.device | str | None) -> device_load.Staging | None:
        staging = staging_for(device)
        if staging is not None:
            copy = staging.copy

            def counted(source: torch.Tensor, destination: torch.Tensor) -> object:
                copied[0] += source.numel()
                return copy(source, destination)

            staging.copy = counted  # type: ignore[method-assign]
        return staging

    device_load.staging_for = counting  # type: ignore[assignment]
    try:
        load()
    finally:
        device_load.staging_for = staging_for  # type: ignore[assignment]
    return copied[0]


def write_json(path: str, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2) + "\n")


def timed(load: Callable[[], None]) -> tuple[float, int]:
    """Seconds and minor page faults of one load."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    load()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=None, help="MiB of parameters (default: 200 on the CPU, 368 on a GPU)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default: 9 on the CPU, 7 on a GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model lives (cuda: see above)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--staged-on-cpu", action="store_true", help="also time fabric.load through the staged path on the CPU")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--cold", action="store_true", help="evict the checkpoint files from the page cache before every load")
    parser.add_argument("--malloc", choices=["default", "reuse"], default="default", help="glibc's thresholds (see above)")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--first-load", action="store_true", help="time each load as the first one of a new process")
    parser.add_argument("--child", nargs=2, metavar=("ROOT", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        sys.exit(main_cuda(args))
    args.size_mb = args.size_mb or 200
    args.reps = args.reps or 9
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
    names = [
        "file: torch.load + load_state_dict",
        "file: fabric.load",
        "folder: dcp.load in place",
        "folder: load_sharded",
        "folder: load_sharded, no binding check",
    ]
    if args.staged_on_cpu:
        names.append("file: fabric.load, staged on the CPU")
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
    bound_pair = ("folder: load_sharded", "folder: load_sharded, no binding check")
    print(
        f"load_sharded / the same without the check that binds each data file to its save:"
        f" {ratio(*bound_pair, statistics.median):.3f}x (minimums {ratio(*bound_pair, min):.3f}x)"
    )
    staged_pair = ("file: fabric.load, staged on the CPU", "file: torch.load + load_state_dict")
    if args.staged_on_cpu:
        print(f"fabric.load staged on the CPU / raw file load: {ratio(*staged_pair, statistics.median):.2f}x (minimums {ratio(*staged_pair, min):.2f}x)")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "checkpoint_load",
                "device": "cpu",
                "torch": torch.__version__,
                "size_mb": args.size_mb,
                "reps": args.reps,
                "where": where,
                "median_ms": {name: statistics.median(values) * 1000 for name, values in times.items()},
                "min_ms": {name: min(values) * 1000 for name, values in times.items()},
                "ratio": ratio(*file_pair, statistics.median),
                "ratio_min": ratio(*file_pair, min),
                "ratio_sharded": ratio(*folder_pair, statistics.median),
                "ratio_binding": ratio(*bound_pair, statistics.median),
                **({"ratio_staged_on_cpu": ratio(*staged_pair, statistics.median)} if args.staged_on_cpu else {}),
            },
        )


if __name__ == "__main__":
    main()
