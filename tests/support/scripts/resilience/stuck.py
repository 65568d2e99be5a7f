"""A 2-rank DDP job in which one rank never joins a collective the other one waits in.

    python stuck.py OUTDIR --start-method popen|spawn --stuck RANK --how sleep|spin [--with-function]

Every rank writes ``pid{rank}`` when it starts; the rank that goes to the collective writes
``enter{rank}`` (a time.time() stamp) just before entering it. The test asserts that the job ends
within 15 s of that stamp, non-zero, naming the stuck rank and the line it is stuck at (the lines
marked ``STUCK``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from fabric import Fabric
from fabric.strategies.ddp import DDPStrategy


def stuck_forever(how: str) -> None:
    if how == "sleep":
        time.sleep(600)  # STUCK-SLEEP
    spins = 0
    while spins >= 0:  # STUCK-SPIN
        spins += 1


def train(fabric: Fabric, outdir: str, stuck: int, how: str) -> None:
    out = Path(outdir)
    (out / f"pid{fabric.global_rank}").write_text(str(os.getpid()))
    if fabric.global_rank == stuck:
        stuck_forever(how)
    (out / f"enter{fabric.global_rank}").write_text(repr(time.time()))
    fabric.all_reduce(torch.ones(3), reduce_op="sum")  # the collective the stuck rank never joins
    (out / f"left{fabric.global_rank}").write_text("the collective returned: it should not have")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("--start-method", default="popen")
    parser.add_argument("--stuck", type=int, default=1)
    parser.add_argument("--how", default="sleep")
    parser.add_argument("--with-function", action="store_true")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = DDPStrategy(timeout=timedelta(seconds=args.timeout), start_method=args.start_method)
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    if args.start_method == "popen" and not args.with_function:
        fabric.launch()
        train(fabric, args.outdir, args.stuck, args.how)
    else:
        fabric.launch(train, args.outdir, args.stuck, args.how)
    sys.exit(0)


if __name__ == "__main__":
    main()
