"""What runs before a process ends (``fabric._core.process_end``): once, in order, and also before ``os._exit``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fabric._core import process_end
from support.environment import clean_env

pytestmark = pytest.mark.cold


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry of the test's own: nothing of this process's loggers runs, nothing goes to atexit."""
    monkeypatch.setattr(process_end, "_callbacks", [])
    monkeypatch.setattr(process_end, "_finished", None)
    monkeypatch.setattr(process_end, "_atexit_registered", True)


def test_callbacks_run_once_in_order_and_one_failure_does_not_stop_the_others(registry: None, capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    def fails() -> None:
        calls.append("fails")
        raise OSError("disk full")

    def first() -> None:
        calls.append("first")

    def last() -> None:
        calls.append("last")

    for callback in (first, fails, first, last):  # registered twice while waiting: runs once
        process_end.at_process_end(callback)
    process_end.run_process_end_callbacks()
    process_end.run_process_end_callbacks()
    assert calls == ["first", "fails", "last"]
    assert "disk full" in capsys.readouterr().err
    process_end.at_process_end(first)  # registered after a run: runs at the next one
    process_end.run_process_end_callbacks()
    assert calls == ["first", "fails", "last", "first"]


@pytest.mark.timeout(30)
def test_a_second_caller_waits_for_the_run_under_way(registry: None) -> None:
    """The supervision thread about to ``os._exit`` must not cut short what the main thread's atexit writes."""
    started, release, written = threading.Event(), threading.Event(), threading.Event()

    def slow_write() -> None:
        started.set()
        release.wait(10)
        written.set()

    process_end.at_process_end(slow_write)
    runner = threading.Thread(target=process_end.run_process_end_callbacks)
    runner.start()
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    process_end.run_process_end_callbacks(timeout=10)
    assert written.is_set()
    runner.join(10)


@pytest.mark.timing
@pytest.mark.timeout(30)
def test_a_hung_callback_keeps_a_hard_end_waiting_only_for_the_timeout(registry: None) -> None:
    hang = threading.Event()
    process_end.at_process_end(lambda: hang.wait(20))
    start = time.monotonic()
    process_end.run_process_end_callbacks(timeout=0.5)
    assert time.monotonic() - start < 5
    hang.set()


_HUNG_AT_EXIT = """
import sys, threading
from fabric._core import process_end

process_end.HARD_END_WAIT_S = float(sys.argv[1])
process_end.at_process_end(lambda: threading.Event().wait(120))  # an upload to a store that does not answer
print("ending", flush=True)
"""


@pytest.mark.procs
@pytest.mark.timing
@pytest.mark.timeout(60)
def test_a_hung_callback_keeps_a_normal_end_waiting_only_for_the_bound(tmp_path: Path) -> None:
    """At a normal end (atexit) too, the process waits for the callbacks at most HARD_END_WAIT_S, says so, and ends."""
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent(_HUNG_AT_EXIT))
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), "1"], env=clean_env(), capture_output=True, text=True, timeout=50)
    assert time.monotonic() - started < 15, result.stderr
    assert result.returncode == 0 and result.stdout == "ending\n", result.stderr
    assert "did not finish within 1 s; ending without it" in result.stderr


_FORKED = """
import os, sys
from fabric._core.process_end import at_process_end, run_process_end_callbacks

out = sys.argv[1]
at_process_end(lambda: open(os.path.join(out, f"ran-{os.getpid()}"), "w").close())
pid = os.fork()
if pid == 0:
    run_process_end_callbacks()  # what fabric's fork workers and hard ends do before os._exit
    os._exit(0)
os.waitpid(pid, 0)
print(os.getpid(), pid)  # the parent's callbacks run at its normal end, through atexit
"""


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_what_its_parent_registered_and_so_does_the_parent(tmp_path: Path) -> None:
    script = tmp_path / "forked.py"
    script.write_text(textwrap.dedent(_FORKED))
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], env=clean_env(), capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    parent, child = result.stdout.split()
    assert sorted(path.name for path in tmp_path.glob("ran-*")) == sorted([f"ran-{parent}", f"ran-{child}"])


_SIGTERM_SCRIPT = textwrap.dedent("""\
    import os, signal, sys, time
    from fabric._core.process_end import at_process_end, run_process_end_callbacks_on_sigterm
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "user handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(7))
    at_process_end(lambda: open(os.path.join(out, f"ran-{os.getpid()}"), "w").close())
    run_process_end_callbacks_on_sigterm()
    print(f"parent {os.getpid()}", flush=True)
    child = os.fork() if mode == "default" else -1
    if child == 0:  # a DataLoader worker's place: its inherited handler must not write for the job
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        os._exit(3)
    if child > 0:
        _, status = os.waitpid(child, 0)
        print(f"child {os.waitstatus_to_exitcode(status)}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
""")


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="a forked child")
@pytest.mark.parametrize("mode", ["default", "user handler"])
def test_sigterm_runs_the_callbacks_in_the_process_that_asked_and_ends_it_as_before(tmp_path: Path, mode: str) -> None:
    """A rank stopped with SIGTERM by its launcher writes what it holds, then ends killed by SIGTERM; a forked copy
    ends at once; a handler of the user's is left in place."""
    result = subprocess.run([sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path), mode], env=clean_env(),
                            capture_output=True, text=True, timeout=50)
    parent = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("parent "))
    ran = sorted(path.name for path in tmp_path.iterdir())
    assert ran == [f"ran-{parent}"], (ran, result.stdout, result.stderr)  # in the parent only
    if mode == "default":
        assert "child -15" in result.stdout, result.stdout + result.stderr  # the fork ended at once
        assert result.returncode == -15, result.stderr  # ended by SIGTERM, as without the handler
    else:
        assert result.returncode == 7, result.stderr  # the user's handler stayed in place (its sys.exit ran atexit)
