"""Checkpoint writers to be killed with SIGKILL mid-save: ``python save_writer.py`` then commands on stdin.

Importing torch takes seconds, forking a process that has it takes milliseconds, so this process
imports once and forks a writer per command:

    fork MODE PATH FIRST_VERSION NUMEL   -> prints the writer's pid
    quit

MODE "fabric" saves with ``Fabric.save`` (atomic), MODE "torch" with ``torch.save`` straight to PATH.
A writer saves versions FIRST_VERSION, FIRST_VERSION + 1, ... in an endless loop until killed.
SIGCHLD is ignored, so a killed writer's pid disappears at once, as after a real crash.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from fabric import Fabric


def payload(version: int, numel: int) -> dict:
    """Every part says which version it is, so a mix of two versions is detectable."""
    return {
        "version": version,
        "weights": torch.full((numel,), float(version)),
        "tail": torch.arange(4096) + version,
        "meta": {"numel": numel, "name": f"v{version}"},
    }


def version_of(state: dict, numel: int) -> int:
    """The version ``state`` holds whole; AssertionError if it is a mix."""
    version = state["version"]
    assert state["meta"] == {"numel": numel, "name": f"v{version}"}, state["meta"]
    assert state["weights"].shape == (numel,) and bool((state["weights"] == float(version)).all())
    assert torch.equal(state["tail"], torch.arange(4096) + version)
    return version


def write_forever(mode: str, path: str, version: int, numel: int) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    while True:
        state = payload(version, numel)
        if mode == "fabric":
            fabric.save(path, state)
        else:
            torch.save(state, path)
        version += 1


def main() -> None:
    torch.set_num_threads(1)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        mode, path, first, numel = args[0], args[1], int(args[2]), int(args[3])
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(mode, path, first, numel)
            finally:
                os._exit(1)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
