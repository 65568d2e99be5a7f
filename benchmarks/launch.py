"""Start-to-exit time of a trivial 2-process job: Fabric's own launcher vs torchrun, same run.

The job (written to a temporary directory) creates ``Fabric(strategy="ddp", devices=2)`` on the CPU,
launches, does one ``all_reduce`` and exits. It is timed as ``python job.py`` (Fabric starts the
second process itself) and as ``python -m torch.distributed.run --nproc-per-node 2 job.py`` (torchrun
starts both; Fabric only joins). A raw-PyTorch job under torchrun is timed as well, for reference.
Runs alternate so that machine noise hits every variant alike; medians are compared.

    python benchmarks/launch.py [--runs 7]

Goal: ratio <= 1.00 (Fabric's launcher no slower than torchrun).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FABRIC_JOB = """
import torch
from fabric import Fabric

fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
total = fabric.all_reduce(torch.tensor(fabric.global_rank + 1), reduce_op="sum")
assert int(total) == 3, total
"""

RAW_JOB = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor(dist.get_rank() + 1)
dist.all_reduce(total)
assert int(total) == 3, total
dist.destroy_process_group()
"""

# variables that would make a job believe it already runs under a launcher
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "NODE_RANK", "TORCHELASTIC_RUN_ID", "FABRIC_PARENT_PID", "FABRIC_STATUS_FD")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("FABRIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # torchrun sets OMP_NUM_THREADS=1 for its workers; give our job the same so only the launcher differs
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _torchrun(script: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port()), str(script)]


def _time(command: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr.decode()[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each variant (after one warm-up)")
    args = parser.parse_args()

    env = _environment()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        fabric_job = workdir / "fabric_job.py"
        raw_job = workdir / "raw_job.py"
        fabric_job.write_text(FABRIC_JOB)
        raw_job.write_text(RAW_JOB)
        variants = {
            "fabric (python job.py)": lambda: [sys.executable, str(fabric_job)],
            "fabric job under torchrun": lambda: _torchrun(fabric_job),
            "raw torch job under torchrun": lambda: _torchrun(raw_job),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for command in variants.values():  # warm-up: file system caches, .pyc files
            _time(command(), env, workdir)
        for _ in range(args.runs):
            for name, command in variants.items():
                times[name].append(_time(command(), env, workdir))

    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:32s} median {medians[name]:.3f} s   runs: {' '.join(f'{v:.2f}' for v in values)}")
    ratio = medians["fabric (python job.py)"] / medians["fabric job under torchrun"]
    print(f"launch ratio fabric/torchrun (same job): {ratio:.3f}x   (goal <= 1.00x)")
    raw_ratio = medians["fabric (python job.py)"] / medians["raw torch job under torchrun"]
    print(f"launch ratio fabric/torchrun (raw torch job): {raw_ratio:.3f}x")


if __name__ == "__main__":
    main()
