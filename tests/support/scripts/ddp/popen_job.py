"""A real ``strategy="ddp"`` script: ``python popen_job.py OUTDIR``. Fabric re-runs it for rank 1.

Every rank saves what it saw to ``OUTDIR/rank{N}.pt``; the test asserts on both files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fabric import Fabric

if __package__:
    from .checks import popen_job
else:
    from checks import popen_job


def main() -> None:
    outdir = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    # with start method "popen", launch(fn) runs fn in every rank and returns each rank's own value
    results = fabric.launch(popen_job, str(outdir))
    results["launch_returned_in_rank"] = fabric.global_rank
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
