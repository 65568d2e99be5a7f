"""What a checked ``fabric.load`` costs compared with a plain load, for a single file and a folder of shards.

``fabric.load`` checks before it changes anything: every record's CRC-32 (beside the read, in a second
thread), the keys and shapes of every entry, and, for a folder of shards, reads into new storage so a
failed read changes nothing (one extra copy of the loaded state while it runs). This measures the
price against what a raw script does, in the same process, in a new random order each repetition:

* file, ``torch.load + load_state_dict``  -- the raw single-file load;
* file, ``fabric.load``                   -- ours (CRC check, fit checks, then the same copies);
* folder, ``dcp.load in place``           -- the raw sharded load: torch.distributed.checkpoint reading
                                             straight into the model's and optimizer's tensors;
* folder, ``load_sharded``                -- ours (index and file-size checks, CRC of every item, reads
                                             into new storage, then copies in).

One process; the file is ``--size-mb`` of parameters, the folder the same model with its Adam state.
Files are in the page cache after the first repetition, so this is the CPU cost of the checks, the
part that a faster disk does not hide; with ``--cold`` (root) the page cache is dropped before every
load, so the files come from the disk. Medians and minimums over repetitions.

    python benchmarks/checkpoint_load.py [--size-mb 200] [--reps 9] [--dir DIR] [--cold]
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
from torch import nn


def model_of(size_mb: int) -> nn.Module:
    width = 1024
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every load (needs root): loads from the disk")
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fabric import Fabric
    from fabric.checkpoint.sharded_folder import load_sharded, save_sharded

    torch.manual_seed(0)
    model = model_of(args.size_mb)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    fabric = Fabric(accelerator="cpu", devices=1)
    root = Path(tempfile.mkdtemp(prefix="load-bench-", dir=args.dir))
    file, folder = root / "model.pt", root / "sharded"
    fabric.save(file, {"model": model})
    save_sharded(folder, {"model": model, "optimizer": optimizer})

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

    raw_state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(raw_state, checkpoint_id=root / "raw", no_dist=True)
    variants: dict[str, Callable[[], None]] = {
        "file: torch.load + load_state_dict": raw_file,
        "file: fabric.load": ours_file,
        "folder: dcp.load in place": raw_folder,
        "folder: load_sharded": ours_folder,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        order = list(variants)
        random.shuffle(order)
        for name in order:
            if args.cold:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("1\n")
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    shutil.rmtree(root)
    print(f"{args.size_mb} MB of parameters, {args.reps} repetitions, {'cold (from disk)' if args.cold else 'page cache'}, torch {torch.__version__}")
    print(f"{'variant':44s} {'median ms':>10s} {'min ms':>8s}")
    for name, values in times.items():
        print(f"{name:44s} {statistics.median(values) * 1000:10.1f} {min(values) * 1000:8.1f}")
    file_ratio = statistics.median(times["file: fabric.load"]) / statistics.median(times["file: torch.load + load_state_dict"])
    folder_ratio = statistics.median(times["folder: load_sharded"]) / statistics.median(times["folder: dcp.load in place"])
    print(f"fabric.load / raw file load: {file_ratio:.2f}x; load_sharded / dcp.load in place: {folder_ratio:.2f}x (medians)")


if __name__ == "__main__":
    main()
