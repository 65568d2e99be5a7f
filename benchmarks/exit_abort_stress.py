"""Stress test for aborts at interpreter exit: many small four-rank gloo jobs, counted by how they ended.

Each job is the multi-node test's job (tests/support/scripts/multinode/ddp_job.py: collectives, a few DDP
steps, results written to JSON) started as two "nodes" of two ranks each with ``fabric-torch run`` on
loopback, exactly as tests/test_multinode.py does. A job counts as clean when both nodes exit 0 and
all four result files exist. Anything else is listed with the end of its stderr; an exit status of
134 with "terminate called" in it is the abort this script was written to catch.

    python benchmarks/exit_abort_stress.py [--jobs 300] [--parallel 2] [--strategy ddp|fsdp] [--cores DIR]

Not part of the test suite (300 jobs take a while on a small machine). With ``--cores DIR`` the
ranks may dump core into DIR (``ulimit -c unlimited``; the kernel's core_pattern decides the name).
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "support" / "scripts" / "multinode" / "ddp_job.py"
_JOB_PREFIXES = ("FABRIC_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_")
_JOB_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
              "GROUP_RANK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(cores: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_PREFIXES) and k not in _JOB_NAMES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def _allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_job(index: int, strategy: str, cores: Path | None, timeout: float) -> tuple[str, str]:
    """One four-rank job; (outcome, detail) where outcome is "ok", "abort134", "timeout" or "exit<codes>"."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix=f"exit-stress-{index}-") as out:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "fabric", "run", "--accelerator", "cpu", "--strategy", strategy, "--devices", "2",
                 "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1", "--main-port", str(port),
                 str(JOB), out],
                env=_environment(cores), cwd=cores or REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, stdin=subprocess.DEVNULL, preexec_fn=_allow_cores if cores else None,
            )
            for node in (1, 0)
        ]
        deadline = time.monotonic() + timeout
        errors, codes = [], []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                return "timeout", ""
            errors.append(err)
            codes.append(proc.returncode)
        complete = all((Path(out) / f"rank{r}.json").exists() for r in range(4))
    stderr = "\n".join(errors)
    if codes == [0, 0] and complete:
        return "ok", ""
    if 134 in codes and "terminate called" in stderr:
        return "abort134", stderr[-1500:]
    return f"exit{codes}{'' if complete else '-incomplete'}", stderr[-1500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=2, help="jobs at the same time")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="what the jobs train with")
    parser.add_argument("--cores", type=Path, default=None, help="let ranks dump core into this folder")
    args = parser.parse_args()
    if args.cores:
        args.cores.mkdir(parents=True, exist_ok=True)

    counts: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_job, i, args.strategy, args.cores, args.timeout) for i in range(args.jobs)]
        for done, future in enumerate(futures, 1):
            outcome, detail = future.result()
            counts[outcome] += 1
            if outcome != "ok":
                print(f"--- job {done}: {outcome}\n{detail}", flush=True)
            if done % 25 == 0:
                print(f"[{done}/{args.jobs}] {dict(counts)} ({time.monotonic() - started:.0f} s)", flush=True)
    bad = args.jobs - counts["ok"]
    print(f"exit_abort_stress: {args.jobs} four-rank {args.strategy} jobs, {counts['abort134']} exit-134 aborts, {bad} not clean "
          f"{dict(counts)} in {time.monotonic() - started:.0f} s (goal 0 aborts)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
