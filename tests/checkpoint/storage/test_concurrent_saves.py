"""Two writers of one URL at once (two jobs, or a job and its restarted copy): the URL always holds one whole save.

A save to a store writes its objects under a new generation, then the commit record; its clean-up removes older
generations. Two interleavings lost the checkpoint before (the record named a generation the other writer's
clean-up had removed); each is forced here, in one process, at the exact step, on ``memory://``; then two real
jobs save to an S3 server at once, 10 rounds of 5 saves each.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fabric._core.urls import filesystem
from fabric.checkpoint.storage import objects
from fabric.checkpoint.storage.objects import ConcurrentSaveError
from fabric.plugins.io import atomic_save, safe_load
from support.environment import clean_env
from support.loading import script_path

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


@pytest.fixture
def memory_url() -> str:
    import secrets

    import fsspec

    folder = f"memory://fabric-concurrent-{secrets.token_hex(4)}"
    yield folder
    fs = fsspec.filesystem("memory")
    if fs.exists(folder[len("memory://") :]):
        fs.rm(folder[len("memory://") :], recursive=True)


def state(value: float) -> dict:
    return {"code": value, "weight": torch.full((32, 32), value)}


def assert_one_whole_save(url: str, codes: set[float]) -> float:
    loaded = safe_load(url)
    assert loaded["code"] in codes
    assert torch.equal(loaded["weight"], torch.full((32, 32), loaded["code"]))
    return loaded["code"]


class Paused:
    """Writer B's save, run in a thread, stopped just before it writes its commit record until ``go`` is set."""

    def __init__(self, url: str, value: float, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at_commit, self.go, self.error = threading.Event(), threading.Event(), None
        original = objects.write_record
        thread_name = f"writer-{value}"

        def write_record(fs, path, record):  # type: ignore[no-untyped-def]
            if threading.current_thread().name == thread_name and not self.at_commit.is_set():
                self.at_commit.set()
                assert self.go.wait(30)
            return original(fs, path, record)

        monkeypatch.setattr(objects, "write_record", write_record)
        self.thread = threading.Thread(target=self._run, args=(url, value), name=thread_name)
        self.thread.start()
        assert self.at_commit.wait(30)

    def _run(self, url: str, value: float) -> None:
        try:
            atomic_save(state(value), url)
        except BaseException as err:
            self.error = err

    def finish(self) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_a_save_whose_objects_the_other_writers_clean_up_removed_restores_the_other_record(memory_url, monkeypatch):
    """B writes its objects, A saves whole (its clean-up removes B's older, uncommitted generation), then B commits:
    B finds its objects gone, puts A's record back and raises; the URL holds A's save."""
    url = f"{memory_url}/ckpt.pt"
    atomic_save(state(0.0), url)
    b = Paused(url, 2.0, monkeypatch)
    atomic_save(state(1.0), url)  # A: a newer generation, committed; B's is older and not named by the record
    b.finish()
    assert isinstance(b.error, ConcurrentSaveError) and "another save of the same URL" in str(b.error)
    assert assert_one_whole_save(url, {1.0, 2.0}) == 1.0
    atomic_save(state(3.0), url)  # and the next save cleans up after both
    assert assert_one_whole_save(url, {3.0}) == 3.0
    fs, path = filesystem(url)
    assert len(fs.ls(f"{path}{objects.DATA_SUFFIX}", detail=False)) == 1


def test_a_clean_up_that_removed_a_generation_committed_meanwhile_writes_its_own_record_back(memory_url, monkeypatch):
    """A's clean-up has listed and read the record (naming A's save) when B commits its older generation; A then
    removes it: A reads the record again, sees it names what it removed, and writes its own record back."""
    url = f"{memory_url}/ckpt.pt"
    b = Paused(url, 2.0, monkeypatch)  # B's generation is the older one
    fs, _ = filesystem(url)
    original_rm = type(fs).rm

    def rm(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread() and not b.go.is_set():
            b.finish()  # B commits (its objects are still there) and cleans up (A's generation is newer: kept)
            assert b.error is None
        return original_rm(self, path, *args, **kwargs)

    monkeypatch.setattr(type(fs), "rm", rm)
    atomic_save(state(1.0), url)  # A
    assert b.go.is_set(), "A's clean-up never removed B's generation: the interleaving was not reached"
    assert assert_one_whole_save(url, {1.0, 2.0}) == 1.0


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_two_jobs_saving_to_one_url_at_once_always_leave_one_whole_save(s3_bucket: str, tmp_path: Path) -> None:
    """Two real jobs, 10 rounds of 5 saves each to the same URL at the same moment: every round's URL loads one whole
    save (every tensor holding that save's code), the last one some writer committed."""
    writer = load_writer()
    rounds, saves = 10, 5
    ready = tmp_path / "ready"
    ready.mkdir()
    prefix = f"{s3_bucket}/shared"
    jobs = [
        subprocess.Popen(
            [sys.executable, str(script_path("checkpoint", "concurrent_writer.py")), prefix, str(w), str(rounds), str(saves), str(ready)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
        )
        for w in (1, 2)
    ]
    outputs = [job.communicate(timeout=240) for job in jobs]
    for job, (_out, err) in zip(jobs, outputs):
        assert job.returncode == 0, err[-3000:]
    lost = {tuple(int(part) for part in line.split()[1:]) for out, _ in outputs for line in out.splitlines() if line.startswith("lost ")}
    for round_ in range(rounds):
        loaded = safe_load(f"{prefix}/round-{round_}")
        codes = {writer.code(w, round_, i) for w in (1, 2) for i in range(saves) if (w, round_, i) not in lost}
        assert loaded["code"] in codes, (round_, loaded["code"])
        for tensor in loaded["model"].values():
            assert torch.equal(tensor, torch.full_like(tensor, loaded["code"])), round_


def load_writer():  # type: ignore[no-untyped-def]
    from support.loading import load_script

    return load_script("checkpoint", "concurrent_writer")
