"""SIGKILL during saves to a real S3 server (moto's, on 127.0.0.1, in this test's process: it outlives the kill).

A job (``support/scripts/checkpoint/store_writer.py``) saves checkpoints to ``s3://`` back to back; the test kills
it at a random moment, then loads the URL: it must hold the last save that returned (or the one after it, if the
kill landed between its commit and the job's report), whole, with every value the step says. Then the next try
starts where the last one stopped. Some saves are one PUT, some a multipart upload, so kills land in both. At
the end, a checkpoint whose commit record is gone is refused, and the next complete save removes what the
killed saves left behind.

``LAYOUTS`` says how a layout is saved and loaded: a sharded layout is one more entry (and one more entry in the
script's LAYOUTS).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fabric import Fabric
from fabric._core.urls import filesystem
from fabric.checkpoint.storage import objects as storage
from support.environment import job_environment
from support.loading import load_script, script_path

pytestmark = [pytest.mark.timing, pytest.mark.procs, pytest.mark.usefixtures("clean_fabric_env")]

writer = load_script("checkpoint", "store_writer")
payloads = load_script("checkpoint", "save_writer")
TRIES = 8


@dataclass(frozen=True)
class Layout:
    devices: int  # processes of the job (the test kills one of them: ``victim``)
    victim: int
    load: Callable[[str], dict]  # the checkpoint at the URL, as a dict of plain values


def load_file(url: str) -> dict:
    return Fabric(accelerator="cpu", devices=1).load(url)


LAYOUTS = {
    "file": Layout(devices=1, victim=0, load=load_file),
    "sharded": Layout(devices=2, victim=1, load=load_file),  # the whole checkpoint read back in one process
}


class Job:
    """One run of ``store_writer.py``: each rank reports to a file of its own; the job's output is kept for errors."""

    def __init__(self, url: str, first: int, layout: str, tmpdir: Path) -> None:
        self.lines: list[str] = []
        self.reports = tmpdir / f"reports-{first}-{time.monotonic_ns()}"
        self.reports.mkdir()
        self.proc = subprocess.Popen(
            [sys.executable, str(script_path("checkpoint", "store_writer.py")), url, str(first), str(self.reports),
             "--layout", layout, "--devices", str(LAYOUTS[layout].devices)],
            env=job_environment(TMPDIR=str(tmpdir)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def reported(self, rank: int) -> list[str]:
        """Rank ``rank``'s complete report lines so far (a line still being written is left for later)."""
        path = self.reports / f"rank-{rank}.txt"
        text = path.read_text() if path.exists() else ""
        return text.split("\n")[:-1]

    def steps(self, word: str) -> list[int]:
        return [int(line.split()[1]) for line in self.reported(0) if line.startswith(f"{word} ")]

    def pids(self) -> dict[int, int]:
        ranks = (int(path.stem.split("-")[1]) for path in self.reports.glob("rank-*.txt"))
        pids = {rank: [line.split()[1] for line in self.reported(rank) if line.startswith("pid ")] for rank in ranks}
        return {rank: int(found[0]) for rank, found in pids.items() if found}

    def wait_started(self, ranks: int, deadline: float) -> None:
        while len(self.pids()) < ranks:
            assert self.proc.poll() is None, "the job ended:\n" + "\n".join(self.lines[-40:])
            assert time.monotonic() < deadline, "the job did not start in time:\n" + "\n".join(self.lines[-40:])
            time.sleep(0.01)

    def end(self, deadline: float) -> None:
        """After a rank was killed: the whole job ends (its other processes too) before the deadline."""
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("the job went on after one of its processes was killed")
        self._reader.join(timeout=10)


def check_holds(state: dict, step: int) -> None:
    """``state`` is step ``step``'s save, whole: every value says that step."""
    assert payloads.version_of(state, writer.numel_of(step)) == step
    if "model" in state:  # the sharded layout's FSDP module: every parameter says the step too
        assert all(bool((tensor == float(step)).all()) for tensor in state["model"].values()), step


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sigkill_during_saves_to_a_bucket_leaves_the_last_complete_checkpoint(s3_bucket: str, layout: str, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    url = f"{s3_bucket}/run/ckpt.pt"
    spec = LAYOUTS[layout]
    confirmed = -1  # the last step whose save returned
    loaded = -1  # the step the URL held after the last try
    first = 0
    interrupted = 0  # kills that landed while a save was under way
    # whose staging folders may still be in TMPDIR: the processes of the jobs since the last one with a returned
    # save (every rank of that one staged, and its first staging swept the folders of every earlier, dead job)
    may_leave: set[int] = set()
    for attempt in range(TRIES):
        where = f"(seed {seed}, try {attempt})"
        deadline = time.monotonic() + 120
        job = Job(url, first, layout, tmp_path)
        job.wait_started(spec.devices, deadline)
        time.sleep(rng.uniform(0.0, 4.0))
        os.kill(job.pids()[spec.victim], signal.SIGKILL)
        job.end(deadline)
        started, saved = job.steps("start"), job.steps("saved")
        if started and (not saved or started[-1] != saved[-1]):
            interrupted += 1
        if saved:
            confirmed = saved[-1]
        # the URL holds the latest complete save: the last one known (returned, or found by the last try), or
        # this try's last, if the kill landed after its commit record was written but before it returned
        known = max(confirmed, loaded)
        possible = {step for step in (known, started[-1] if started else -1) if step >= 0}
        try:
            state = spec.load(url)
        except FileNotFoundError:
            assert known < 0, f"{where}: the checkpoint of step {known} is gone"
        else:
            assert state["version"] in possible, (where, state["version"], possible)
            check_holds(state, state["version"])
            loaded = state["version"]
        print(f"{where}: started {started[-2:]}, returned {saved[-2:]}, the URL holds step {loaded}")  # shown on failure
        first = (started[-1] + 1) if started else first
        may_leave = set(job.pids().values()) | (set() if saved else may_leave)
    # a killed rank's local staging folder (sharded saves) goes with the next job's first save
    left = [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(storage.STAGING_PREFIX)]
    assert all(int(name.split("-")[3]) in may_leave for name in left), (left, may_leave)
    assert interrupted >= TRIES // 2, f"only {interrupted} of {TRIES} kills landed mid-save (seed {seed})"
    assert loaded >= 0, f"no save completed in {TRIES} tries (seed {seed})"

    # what the killed saves left (objects of generations no record names) goes with the next complete save
    fs, path = filesystem(url)
    Fabric(accelerator="cpu", devices=1).save(url, payloads.payload(first, writer.numel_of(first)))
    fs.invalidate_cache()
    assert len(fs.ls(f"{path}{storage.DATA_SUFFIX}", detail=False)) == 1
    check_holds(spec.load(url), first)

    # a checkpoint whose commit record is missing is refused, naming what is there
    fs.rm(path)
    with pytest.raises(FileNotFoundError, match="objects of a save exist, but no commit record"):
        spec.load(url)
