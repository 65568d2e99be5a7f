"""A job that saves checkpoints to a URL back to back until it is killed (SIGKILL, at a random moment).

    python store_writer.py URL FIRST_STEP REPORTS_DIR [--layout file] [--devices 1]

Each rank writes its reports to a file of its own, ``REPORTS_DIR/rank-RANK.txt`` (ranks sharing one pipe
would interleave their lines): ``pid PID`` once, then rank 0 ``start N`` before the save of step N begins and
``saved N`` after it returned. Steps FIRST_STEP, FIRST_STEP + 1, ... are saved in an endless loop. Every part
of step N's state says N (``save_writer.payload``), so a checkpoint that mixes two saves is caught, and the
size changes with N (``numel_of``): some saves are one PUT, others a multipart upload of several parts.

``--layout``: "file" (one process, a single-file checkpoint) or "sharded" (``strategy="fsdp"``, a folder of
shards on the store, with an FSDP module whose every parameter says N besides the payload); with several
processes the test kills one rank and the job's supervisor takes the others down.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from fabric import Fabric
from support.scripts.checkpoint.save_writer import payload

LAYOUTS = {"file": {"strategy": "auto"}, "sharded": {"strategy": "fsdp"}}
BIG_EVERY = 3  # every third step is big enough for a multipart upload (s3fs sends parts of 50 MiB)


def numel_of(step: int) -> int:
    """How many float32 values step ``step`` saves: 4 MB, or 72 MB (two parts) every BIG_EVERY-th step."""
    return (18 << 20) if step % BIG_EVERY == 0 else (1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("first", type=int)
    parser.add_argument("reports", type=Path)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="file")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=args.devices, **LAYOUTS[args.layout])
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(256, 256)) if args.layout == "sharded" else None
    reports = open(args.reports / f"rank-{fabric.global_rank}.txt", "a", buffering=1)  # noqa: SIM115 (open until killed)
    reports.write(f"pid {os.getpid()}\n")
    step = args.first
    while True:
        if fabric.global_rank == 0:
            reports.write(f"start {step}\n")
        state = payload(step, numel_of(step))
        if model is not None:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.fill_(step)
            state["model"] = model
        fabric.save(args.url, state)
        if fabric.global_rank == 0:
            reports.write(f"saved {step}\n")
        step += 1


if __name__ == "__main__":
    sys.exit(main())
