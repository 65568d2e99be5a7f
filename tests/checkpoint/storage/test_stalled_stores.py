"""A store that stops answering: every call ends within the bound (``FABRIC_STORE_TIMEOUT``) with our message naming
the URL and what was being done, the process ends promptly afterwards (nothing of ours keeps it alive: no thread, no
abandoned upload retried as it is collected), and what was committed before is whole once the server is back.

moto's S3 server runs in a process of its own (``support/s3.py``'s ``s3_process``). A job reaches it through a TCP
proxy that the test cuts (a killed proxy, a dropped network: connections reset, connects refused), or directly while
the test pauses it (SIGSTOP: the kernel still accepts connections and takes requests, nothing answers). The jobs are
``support/scripts/stores/stalled_store.py``; the tests use a bound of a few seconds, so they stay fast.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric._core.process_end import HARD_END_WAIT_S
from fabric.checkpoint.storage.objects import STAGING_PREFIX
from support import PYTHON
from support.environment import clean_env
from support.loading import script_path
from support.s3 import S3Process, forget_filesystems

pytestmark = [pytest.mark.procs, pytest.mark.usefixtures("clean_fabric_env")]

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None

BOUND = 5.0  # FABRIC_STORE_TIMEOUT in these jobs (s)
SLACK = 3.0  # what a loaded machine may add to a bound (s)
# A cut store is out of reach: the save raises TimeoutError when the bound runs out first, an OSError saying the
# endpoint could not be reached when the client's retries of refused connects run out first (both OSErrors),
# whichever comes first on this run; never another class, and the same for a single-file and a sharded save.
UNREACHABLE = ("TimeoutError", "OSError")


class Job:
    """``stalled_store.py MODE URL`` with the server reached at ``endpoint`` and ``bound`` as FABRIC_STORE_TIMEOUT; its
    JSON lines arrive with the time they were read (``at``, monotonic)."""

    def __init__(self, mode: str, url: str, server: S3Process, endpoint: str, bound: float, tmp_path: Path) -> None:
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir(exist_ok=True)
        env = clean_env(FABRIC_STORE_TIMEOUT=str(bound), TMPDIR=str(tmpdir), OMP_NUM_THREADS="1",
                        **server.environment(endpoint))  # fmt: skip
        self.process = subprocess.Popen(
            [PYTHON, str(script_path("stores", "stalled_store.py")), mode, url],
            env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self.ended_at: float | None = None
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.process.stderr), daemon=True).start()  # type: ignore[arg-type]

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            at = time.monotonic()
            self._stdout.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                self._events.put({**event, "at": at})

    def output(self) -> str:
        return "".join(self._stdout)[-3000:] + "\n--- stderr ---\n" + "".join(self._stderr)[-6000:]

    def next(self, event: str, timeout: float) -> dict[str, Any]:
        """The next line of kind ``event`` (a line of another kind first fails the test)."""
        try:
            found = self._events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the job said no {event!r} within {timeout} s:\n{self.output()}") from None
        assert found["event"] == event, f"expected {event!r}, the job said {found}:\n{self.output()}"
        return found

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def ended(self, timeout: float) -> float:
        """When the process ended (monotonic); it must end within ``timeout`` s, with status 0."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.output()}") from None
        self.ended_at = time.monotonic()
        time.sleep(0.2)  # the readers take the last lines
        assert self.process.returncode == 0, f"exit status {self.process.returncode}:\n{self.output()}"
        print(self.output())
        return self.ended_at

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def jobs() -> Any:
    """Starts jobs (``jobs(mode, url, endpoint, bound, tmp_path)``); kills any still running after the test."""
    started: list[Job] = []

    def start(*args: Any) -> Job:
        started.append(Job(*args))
        return started[-1]

    yield start
    for job in started:
        job.kill()
    forget_filesystems()


def from_the_server(server: S3Process, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process reaches the server itself from now on (through no proxy)."""
    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    forget_filesystems()


def small_linear() -> nn.Module:
    torch.manual_seed(0)  # as the job's
    return nn.Linear(4, 4)


def assert_failed_within(failed: dict[str, Any], since: float, bound: float, *names: str) -> None:
    """The call failed within ``bound`` (+ slack) of ``since``, with our message naming ``names`` (URL, what was done),
    not a library's raw text."""
    print(f"{failed['at'] - since:.1f} s: {failed}")
    assert failed["at"] - since < bound + SLACK, failed
    for name in names:
        assert name in failed["message"], failed
    assert "inline_container" not in failed["message"] and "enforce fail" not in failed["message"], failed
    assert f"no answer from the store within {bound:g} s" in failed["message"] or "Could not connect" in failed["message"], failed


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_a_single_file_save_cut_off_from_the_server_fails_within_the_bound_and_the_process_ends(
    s3_process: S3Process, jobs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{s3_process.new_bucket()}/run/ckpt.pt"
    proxy = s3_process.proxy()
    job = jobs("file", url, s3_process, proxy.endpoint, BOUND, tmp_path)
    job.next("saving", 90)
    proxy.wait_sent(proxy.sent + (8 << 20), 60)  # the 64 MB upload is under way
    proxy.cut()
    cut = time.monotonic()
    failed = job.next("failed", 60)
    assert_failed_within(failed, cut, BOUND, f"Could not save the checkpoint {url!r}", "previous checkpoint")
    assert failed["type"] in UNREACHABLE, failed
    assert job.ended(60) - failed["at"] < SLACK
    from fabric.plugins.io import safe_load

    from_the_server(s3_process, monkeypatch)
    assert torch.equal(safe_load(url)["v"], torch.arange(10.0))


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_a_sharded_save_cut_off_from_the_server_fails_within_the_bound_and_the_process_ends(
    s3_process: S3Process, jobs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{s3_process.new_bucket()}/run/sharded"
    proxy = s3_process.proxy()
    job = jobs("sharded", url, s3_process, proxy.endpoint, BOUND, tmp_path)
    job.next("saving", 90)
    proxy.wait_sent(proxy.sent + (8 << 20), 60)
    proxy.cut()
    cut = time.monotonic()
    failed = job.next("failed", 60)
    assert_failed_within(failed, cut, BOUND, f"Saving the sharded checkpoint {url!r} failed; the previous one is kept")
    assert failed["type"] in UNREACHABLE, failed  # as a single-file save's
    assert job.ended(60) - failed["at"] < SLACK
    assert [path.name for path in (tmp_path / "tmp").iterdir() if path.name.startswith(STAGING_PREFIX)] == []  # none left
    from fabric.checkpoint.formats import load_sharded

    from_the_server(s3_process, monkeypatch)
    fresh = nn.Linear(4, 4)
    load_sharded(url, {"model": fresh})
    assert all(torch.equal(value, small_linear().state_dict()[name]) for name, value in fresh.state_dict().items())


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_a_logger_flush_cut_off_from_the_server_fails_within_the_bound_and_the_process_ends(
    s3_process: S3Process, jobs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 3.0
    root = f"{s3_process.new_bucket()}/logs"
    proxy = s3_process.proxy()
    job = jobs("logger", root, s3_process, proxy.endpoint, bound, tmp_path)
    job.next("ready", 90)
    proxy.cut()
    job.go()
    cut = time.monotonic()
    failed = job.next("failed", 60)
    assert failed["logger"] == "CSVLogger"
    assert_failed_within(failed, cut, bound, f"Could not write the log file '{root}/csv/version_0/metrics.csv'")
    if HAS_TENSORBOARD:
        since, failed = failed["at"], job.next("failed", 60)
        assert failed["logger"] == "TensorBoardLogger"
        assert_failed_within(failed, since, bound, f"Could not upload the TensorBoard logs to '{root}/tb/version_0'")
    ending = job.next("ending", 30)
    # as the process ends, each logger tries once more to write what it holds: each call bounded, and all of them by
    # the process end's own bound
    assert job.ended(60) - ending["at"] < HARD_END_WAIT_S + SLACK
    from fabric.loggers.logger import read_text

    from_the_server(s3_process, monkeypatch)
    text = read_text(f"{root}/csv/version_0/metrics.csv")
    assert text is not None and text.splitlines() == ["step,loss", "0,0.0", "1,0.5", "2,1.0"]


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_a_job_logging_to_a_paused_server_ends_within_the_process_end_bound(
    s3_process: S3Process, jobs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loggers' writes at the end of the process wait at most the process end's bound (here shorter than the
    store's, so that bound is the one that ends the job), then the process goes."""
    root = f"{s3_process.new_bucket()}/logs"
    job = jobs("exit", root, s3_process, s3_process.endpoint, 30.0, tmp_path)
    job.next("ready", 90)
    s3_process.pause()
    try:
        job.go()
        ending = job.next("ending", 30)
        assert job.ended(60) - ending["at"] < HARD_END_WAIT_S + SLACK
    finally:
        s3_process.resume()
    from fabric.loggers.logger import read_text

    from_the_server(s3_process, monkeypatch)
    text = read_text(f"{root}/csv/version_0/metrics.csv")  # the rows of the last save (or with the last row, if it landed)
    assert text is not None and text.splitlines()[:4] == ["step,loss", "0,0.0", "1,0.5", "2,1.0"]


@pytest.mark.timing
@pytest.mark.timeout(150)
def test_every_kind_of_call_to_a_paused_server_fails_within_the_bound(
    s3_process: S3Process, jobs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads (a file, a sharded checkpoint), a save, a removal and a listing: each ends within the bound naming the
    URL and what was done; the process ends at once afterwards; the checkpoint nothing touched loads."""
    bound = 2.0
    url = f"{s3_process.new_bucket()}/calls"
    job = jobs("calls", url, s3_process, s3_process.endpoint, bound, tmp_path)
    job.next("ready", 90)
    s3_process.pause()
    try:
        job.go()
        since = time.monotonic()
        expected = {
            "load": f"Could not read the checkpoint '{url}/file.pt'",
            "load_sharded": f"'{url}/sharded'",
            "save": f"Could not save the checkpoint '{url}/other.pt'",
            "remove": f"Could not remove the checkpoint '{url}/file.pt'",
            "list": f"Could not list the log folder '{url}/logs/fabric_logs'",
        }
        for call, named in expected.items():
            failed = job.next("failed", 30)
            assert failed["call"] == call, failed
            assert_failed_within(failed, since, bound, named)
            since = failed["at"]
        ending = job.next("ending", 30)
        assert job.ended(30) - ending["at"] < SLACK
    finally:
        s3_process.resume()
    from fabric.checkpoint.formats import load_sharded

    from_the_server(s3_process, monkeypatch)
    fresh = nn.Linear(4, 4)
    load_sharded(f"{url}/sharded", {"model": fresh})
    assert all(torch.equal(value, small_linear().state_dict()[name]) for name, value in fresh.state_dict().items())
