"""Fault-tolerant test jobs: a ``fabric-torch lighthouse`` and replica groups under ``fabric-torch run``, and what they left.

The groups run ``support/scripts/ft/replica_group.py`` (its docstring says what it logs and which faults it makes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.environment import clean_env
from support.loading import script_path
from support.processes import fabric_run, finish, start

GROUP_SCRIPT = script_path("ft", "replica_group.py")


def start_lighthouse(log: Path, *, min_replicas: int = 1, port: int = 0, heartbeat_ms: int | None = 2000,
                     join_ms: int = 5000) -> tuple[subprocess.Popen, str]:
    """``fabric-torch lighthouse`` (a free port unless ``port``); by default a group is taken for dead after 2 s
    without a heartbeat, and a quorum waits up to 5 s for a group that sends heartbeats but has not asked yet (the
    job's start, a rejoining group). ``heartbeat_ms=None``: the command's own default.

    Its log (a line per quorum) goes to the file ``log`` (appended): a pipe nobody reads would fill and stall it.
    """
    command = [sys.executable, "-m", "fabric", "lighthouse", "--min-replicas", str(min_replicas), "--port", str(port),
               "--join-timeout-ms", str(join_ms)]
    if heartbeat_ms is not None:
        command += ["--heartbeat-timeout-ms", str(heartbeat_ms)]
    with log.open("a") as stderr:
        process = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=stderr, text=True, stdin=subprocess.DEVNULL)
    assert process.stdout is not None
    line = process.stdout.readline()  # its one line on stdout: the address
    assert "lighthouse listening on http://127.0.0.1:" in line, line + log.read_text()
    return process, line.split("listening on ")[1].split()[0]


def stop_lighthouse(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=20)


def start_groups(lighthouse: str, out: Path, *args: object, restarts: int = 0, strategy: str = "ddp_ft",
                 devices: int | tuple[int, ...] = 1, numbers: tuple[int, ...] = (0, 1), groups: int = 2) -> list[subprocess.Popen]:
    """One ``fabric-torch run`` per replica group (``numbers``: their ``--replica-group``; ``devices`` per group)."""
    out.mkdir(exist_ok=True)
    per_group = devices if isinstance(devices, tuple) else (devices,) * len(numbers)
    return [
        start(fabric_run("--accelerator", "cpu", "--devices", count, "--replica-group", number, "--num-replica-groups",
                         groups, "--lighthouse", lighthouse, "--max-restarts", restarts, GROUP_SCRIPT, out, *args),
              env=clean_env(OMP_NUM_THREADS="1", FT_STRATEGY=strategy))
        for number, count in zip(numbers, per_group)
    ]


def run_groups(lighthouse: str, out: Path, *args: object, timeout: float = 200, **kwargs: object) -> list[tuple[int, str, str]]:
    """:func:`start_groups`, then their (status, stdout, stderr), each stderr also kept as ``OUT/group{i}.stderr``."""
    results = finish(start_groups(lighthouse, out, *args, **kwargs), timeout)  # type: ignore[arg-type]
    for index, (_, _, stderr) in enumerate(results):
        (out / f"group{index}.stderr").write_text(stderr)
    return results


def rows(out: Path, group: int, attempt: int, rank: int = 0) -> list[dict]:
    """The steps a rank of a group logged in one attempt."""
    return [json.loads(line) for line in (out / f"group{group}_rank{rank}_attempt{attempt}.jsonl").read_text().splitlines()]


def shard_order(group: int, rank: int, ranks_per_group: int) -> list[int]:
    """The sample indices of (group, rank)'s shard in epoch 0, as the distributed sampler orders them."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(4096), num_replicas=2 * ranks_per_group, rank=group * ranks_per_group + rank, shuffle=True, seed=7)
    sampler.set_epoch(0)
    return list(sampler)


def processes_mentioning(text: str) -> list[int]:
    """The pids of the processes (other than this one) whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found
