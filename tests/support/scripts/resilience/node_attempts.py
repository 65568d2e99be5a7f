"""One rank of a torch-free job that records what each attempt sees, for ``fabric run`` on several nodes.

    python node_attempts.py OUTDIR [--fail-rank R]

Every rank writes ``OUTDIR/attempt{A}-rank{R}.json`` (A = ``TORCHELASTIC_RESTART_COUNT``) with its
rank variables, then sleeps. ``--fail-rank R``: rank R waits until all ranks of its attempt have
written their record (so no rank is stopped before it did), then exits with status 3, in every attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

NAMES = ("RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    record = {name: os.environ.get(name) for name in NAMES}
    (args.outdir / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps(record))
    if rank == args.fail_rank:
        deadline = time.monotonic() + 60
        world = int(os.environ["WORLD_SIZE"])
        while len(list(args.outdir.glob(f"attempt{attempt}-rank*.json"))) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(120)


if __name__ == "__main__":
    main()
