"""Rank 1 fails while rank 0 waits in a collective: horovodrun must end the whole job quickly."""

from __future__ import annotations

import torch

from fabric import Fabric


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy="horovod")
    fabric.launch()
    fabric.barrier()
    if fabric.global_rank == 1:
        raise RuntimeError("boom from rank 1")
    fabric.all_reduce(torch.ones(1))  # never matched: rank 1 is gone
    fabric.barrier()


if __name__ == "__main__":
    main()
