"""A job whose ranks listen for pre-emption (``fabric.preempted``) and then hang in an upload to a store that never
answers (``support/silent_store.py``).

    python hung_upload.py OUT_DIR [--nprocs N] [--how ddp|ddp_spawn] [--hang save|exit]

Every rank reads ``fabric.preempted`` once (from then on SIGTERM is its warning), writes ``OUT_DIR/rank{R}.json``
(its pid), and then:

- ``--hang save``: ``fabric.save("s3://bucket/x", ...)``. Rank 0 uploads and hangs there; the other ranks wait in a
  collective for its outcome (blocked in torch's C++ code, where Python runs no signal handler).
- ``--hang exit``: every rank opens an object on the store for writing, writes to it, leaves it open, writes
  ``OUT_DIR/exiting-rank{R}`` and returns. The object is uploaded when it is collected as the interpreter ends, after
  its daemon threads stopped running: the rank hangs in its own end.

``--nprocs N --how ddp`` starts N ranks with the popen launcher, ``--how ddp_spawn`` runs the same as a function
through ``fabric.launch(function)``; without them the script is the rank of ``fabric run`` (or one process).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from fabric import Fabric

# objects on the store left open, uploaded only when collected as the interpreter ends
_UNCLOSED: list = []


def job(fabric: Fabric, out: Path, hang: str) -> None:
    assert fabric.preempted is False  # listening for the warning from here on
    rank = fabric.global_rank
    record = out / f"rank{rank}.json"
    record.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid()}))
    os.replace(record.with_suffix(".tmp"), record)
    if hang == "save":
        fabric.save("s3://bucket/x", {"weights": torch.zeros(4)})
        (out / f"saved-rank{rank}").write_text("")  # never reached: the store does not answer
        return
    import s3fs

    file = s3fs.S3FileSystem().open(f"bucket/x-rank{rank}", "wb")
    file.write(b"x" * 1000)  # below one part: nothing is sent before the file is closed
    _UNCLOSED.append(file)
    fabric.barrier()
    (out / f"exiting-rank{rank}").write_text("")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--nprocs", type=int)
    parser.add_argument("--how", choices=("ddp", "ddp_spawn"))
    parser.add_argument("--hang", choices=("save", "exit"), default="save")
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = {"devices": args.nprocs, "strategy": args.how} if args.how else {}  # under `fabric run`: its options
    fabric = Fabric(accelerator="cpu", **chosen)
    if args.how == "ddp_spawn":
        fabric.launch(job, args.out, args.hang)
    else:
        fabric.launch()
        job(fabric, args.out, args.hang)


if __name__ == "__main__":
    main()
