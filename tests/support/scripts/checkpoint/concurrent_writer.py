"""One of two jobs that save to the same URLs at the same time (tests/checkpoint/storage/test_concurrent_saves.py).

    python concurrent_writer.py URL_PREFIX WRITER ROUNDS SAVES READY_DIR

Waits until every writer has started (``READY_DIR/ready-W``), then for each round R saves SAVES checkpoints to
``URL_PREFIX/round-R``, back to back. Every tensor of save (WRITER, R, I) holds its code, ``code(WRITER, R, I)``,
so a checkpoint that mixes two saves is caught. A save the other writer's clean-up beat is reported, not fatal
(``lost W R I`` on stdout): the URL then holds the other writer's save, whole.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from fabric import Fabric


def code(writer: int, round_: int, index: int) -> float:
    return float(writer * 10_000 + round_ * 100 + index)


def state_of(writer: int, round_: int, index: int) -> dict:
    value = code(writer, round_, index)
    return {"code": value, "model": {"weight": torch.full((64, 64), value), "bias": torch.full((64,), value)}}


def main() -> None:
    prefix, writer, rounds, saves, ready = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    fabric = Fabric(accelerator="cpu", devices=1)
    (ready / f"ready-{writer}").touch()
    while len(list(ready.glob("ready-*"))) < 2:
        time.sleep(0.01)
    for round_ in range(rounds):
        for index in range(saves):
            try:
                fabric.save(f"{prefix}/round-{round_}", state_of(writer, round_, index))
            except OSError as err:
                if "another save of the same URL" not in str(err):
                    raise
                print(f"lost {writer} {round_} {index}", flush=True)


if __name__ == "__main__":
    main()
