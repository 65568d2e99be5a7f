"""No rank outlives its launcher, also a rank whose own end hangs in an upload to a store that never answers.

A rank that follows its launcher does so with a watchdog thread (``rank_side.follow_supervisor``), and the kernel's
parent-death signal is cleared so that the watchdog can take the rank's subprocesses along. A daemon thread stops
running once the interpreter finalizes, though: an object collected then (a file on a store left open, whose close
uploads it) can keep the rank alive with nobody watching. Real launchers (``fabric run``, the popen launcher,
``ddp_spawn``), real ranks (``support/scripts/resilience/hung_upload.py --hang exit``), a real SIGKILL of the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the parent-death signal and /proc are Linux's", allow_module_level=True)

pytest.importorskip("s3fs")

from support import PYTHON
from support.environment import clean_env
from support.loading import script_path
from support.processes import alive, fabric_run, read_ranks, wait_for_files
from support.silent_store import silent_store

pytestmark = pytest.mark.cold

HUNG = script_path("resilience", "hung_upload.py")


def _command(launcher: str, folder: Path, hang: str) -> list[str]:
    if launcher == "fabric-run":
        return fabric_run("--devices", "2", HUNG, folder, "--hang", hang)
    return [PYTHON, str(HUNG), str(folder), "--nprocs", "2", "--how", "ddp_spawn" if launcher == "spawn" else "ddp", "--hang", hang]


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("launcher", "hang"),
    [
        ("fabric-run", "exit"),
        ("popen", "exit"),
        # a spawned worker's end never hangs unwatched: the launcher stops it once it reported its result; it is
        # SIGKILLed here while its workers hang in the upload (rank 0) and in the collective waiting for it (rank 1)
        ("spawn", "save"),
    ],
)
def test_no_rank_outlives_its_sigkilled_launcher_while_it_hangs_in_an_upload(tmp_path: Path, launcher: str, hang: str) -> None:
    with silent_store() as store, open(tmp_path / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(_command(launcher, tmp_path, hang), env=clean_env(OMP_NUM_THREADS="1", **store),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        ranks: list[int] = []
        try:
            wait_for_files(tmp_path, "exiting-rank*" if hang == "exit" else "rank*.json", 2, timeout=150)
            # under popen the launcher is rank 0 itself: the rank that must follow it is rank 1
            ranks = [record["pid"] for record in read_ranks(tmp_path).values() if record["pid"] != proc.pid]
            time.sleep(3)  # the ranks hang: in the upload of the open object as their interpreter ends, or in the save
            assert all(alive(pid) for pid in ranks), "the ranks were meant to hang"
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            deadline = killed + 15
            while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
                time.sleep(0.05)
            survivors = [pid for pid in ranks if alive(pid)]
            took = time.monotonic() - killed
        finally:
            for pid in [proc.pid, *ranks]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait(30)
    assert not survivors, f"rank(s) {survivors} outlived their SIGKILLed launcher:\n{(tmp_path / 'stderr.txt').read_text()[-4000:]}"
    assert took < 15, took
