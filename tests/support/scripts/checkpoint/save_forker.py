"""Start checkpoint writers on request, so a test can SIGKILL them in the middle of a save.

Importing torch takes seconds; forking a process that has already imported it takes milliseconds.
This process imports torch and fabric once, then reads commands from stdin:

    fork PATH FIRST_VERSION NUMEL   -> forks a writer, prints its pid
    quit

A writer saves ``payload(version)`` to PATH with ``fabric.plugins.io.atomic_save`` in an endless
loop (version FIRST_VERSION, FIRST_VERSION + 1, ...) until it is killed. Writers are reaped by the
kernel (SIGCHLD is ignored), so once killed their pid is gone, as after a real crash.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from fabric.plugins.io import atomic_save  # noqa: E402


def payload(version: int, numel: int) -> dict:
    """A state whose every part says which version it is, so a torn mix of two versions is detectable."""
    return {
        "version": version,
        "data": torch.full((numel,), float(version)),
        "tail": torch.arange(1024) + version,
        "meta": {"numel": numel, "name": f"v{version}"},
    }


def check_payload(state: dict, numel: int) -> int:
    """Raise AssertionError unless ``state`` is exactly one whole version; return that version."""
    version = state["version"]
    assert state["meta"] == {"numel": numel, "name": f"v{version}"}, state["meta"]
    assert state["data"].shape == (numel,)
    assert bool((state["data"] == float(version)).all()), "data of mixed versions"
    assert torch.equal(state["tail"], torch.arange(1024) + version), "tail of another version"
    return version


def _write_forever(path: str, version: int, numel: int) -> None:
    while True:
        atomic_save(payload(version, numel), path)
        version += 1


def main() -> None:
    torch.set_num_threads(1)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        if command != "fork":
            print(f"error: unknown command {command!r}", flush=True)
            continue
        path, first_version, numel = args[0], int(args[1]), int(args[2])
        pid = os.fork()
        if pid == 0:
            try:
                _write_forever(path, first_version, numel)
            finally:
                os._exit(1)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
