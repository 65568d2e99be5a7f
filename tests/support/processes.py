"""Starting, waiting for and reading the processes of a test job; every wait has a deadline."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from support import PYTHON, REPO
from support.environment import clean_env


def fabric_run(*args: Any) -> list[str]:
    """The command line of ``python -m fabric run ARGS``."""
    return [PYTHON, "-m", "fabric", "run", *map(str, args)]


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run to the end (or fail the test after ``timeout`` s, killing it); output in the failure message."""
    try:
        result = subprocess.run(cmd, env=env or clean_env(), cwd=cwd or REPO, capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{cmd} did not end within {timeout} s:\n{_text(err.stdout)}\n{_text(err.stderr)}") from err
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def start(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env or clean_env(), cwd=cwd or REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process (killing all of them if one overruns); (returncode, stdout, stderr) each."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate() for proc in procs]
        raise AssertionError(f"processes did not end within {timeout} s: {outputs}") from None
    return results


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it only waits to be reaped).

    Read from /proc here rather than with ``fabric._core.processes.process_alive``: the tests judge
    fabric's process handling, so they do not lean on it to see whether a process is gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_dead(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"still alive after {timeout} s: {[p for p in pids if alive(p)]}")
        time.sleep(0.05)


def wait_for_files(folder: Path, pattern: str, count: int, timeout: float) -> list[Path]:
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(folder.glob(pattern))
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {count} files {pattern} in {folder} within {timeout} s, got {found}")
        time.sleep(0.05)


def read_ranks(folder: Path) -> dict[int, dict]:
    """rank -> record, from the rank{R}.json files the scripts write."""
    return {int(p.name[4:-5]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
