"""A Fabric job on the CPU that fails as a user's does, for the tests of how a failure is reported.

Usage: failing_job.py FOLDER HOW [--processes N [--spawn]]

HOW is ``wait`` (write FOLDER/rank{R}.json, then sleep: a job to Ctrl-C) or ``mismatch`` (save a model, then load
it into one whose layers have other sizes: every rank meets the same misfit). ``--processes N``: start the ranks
with the popen launcher (``python failing_job.py``), or with ``--spawn`` with ``launch(function)`` in spawned
workers; without it the script runs under ``fabric-torch run``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

# Behave as in a terminal even if the test runner started us with SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

import torch  # noqa: E402

from fabric import Fabric  # noqa: E402


def layers(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def job(fabric: Fabric, folder: str, how: str) -> None:
    out = Path(folder)
    if how == "wait":
        record = out / f"rank{fabric.global_rank}.json"
        record.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid()}))
        os.replace(record.with_suffix(".tmp"), record)
        time.sleep(60)
    elif how == "mismatch":
        model = fabric.setup(layers(8))
        fabric.save(out / "model.pt", {"model": model})
        fabric.load(out / "model.pt", {"model": fabric.setup(layers(3))})
    else:
        raise SystemExit(f"unknown HOW {how!r}")


def main() -> None:
    folder, how, *rest = sys.argv[1:]
    if "--processes" not in rest:
        fabric = Fabric(accelerator="cpu")
    else:
        strategy = "ddp_spawn" if "--spawn" in rest else "ddp"
        fabric = Fabric(accelerator="cpu", devices=int(rest[rest.index("--processes") + 1]), strategy=strategy)
    if "--spawn" in rest:
        fabric.launch(job, folder, how)
    else:
        fabric.launch()
        job(fabric, folder, how)


if __name__ == "__main__":
    main()
