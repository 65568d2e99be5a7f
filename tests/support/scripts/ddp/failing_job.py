"""``python failing_job.py RANK``: rank RANK raises while the other waits in a barrier; the job must end fast."""

from __future__ import annotations

import sys

from fabric import Fabric


def main() -> None:
    failing_rank = int(sys.argv[1])
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    fabric.barrier()
    if fabric.global_rank == failing_rank:
        raise RuntimeError(f"rank {failing_rank} fails on purpose")
    fabric.barrier()  # waits for a rank that is gone: only the launcher can end this


if __name__ == "__main__":
    main()
