"""`fabric run` passes the cluster's pre-emption warnings (SIGUSR1, SIGTERM) on to its ranks.

Real `fabric run` processes, real signals to its pid, and torch-free ranks
(``support/scripts/resilience/signalled_rank.py``) that record what they receive, as does a child
each rank starts in its own process group (standing in for a DataLoader worker, which must not get
the warning). The end-to-end pre-emption of a training job under `fabric run` (same step on every
rank, exact resume) is in ``tests/utilities/test_preemption.py``.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from fabric.supervision.signals import SHUTDOWN_TIMEOUT_S, SignalForwarding, SignalPipe
from support.loading import script_path
from support.processes import fabric_run, finish, read_ranks, start, wait_dead, wait_for_files

pytestmark = pytest.mark.cold

RANK = script_path("resilience", "signalled_rank.py")
RANKS_ENV = script_path("multinode", "ranks_env.py")


def _start_job(folder: Path, *rank_args: object, options: tuple = (), script: Path = RANK) -> tuple[subprocess.Popen, dict]:
    """`fabric run --devices 2 OPTIONS SCRIPT FOLDER RANK_ARGS`, once both ranks are up."""
    proc = start(fabric_run("--devices", "2", *options, script, folder, *rank_args))
    try:
        wait_for_files(folder, "rank*.json", 2, timeout=30)
    except BaseException:
        proc.kill()
        raise
    return proc, read_ranks(folder)


def _received(folder: Path, who: str) -> list[str]:
    path = folder / f"signals-{who}"
    return path.read_text().split() if path.exists() else []


def _all_pids(ranks: dict[int, dict]) -> list[int]:
    return [pid for record in ranks.values() for pid in (record["pid"], record["child"])]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_sigusr1_reaches_every_rank_but_not_its_subprocesses_and_the_job_goes_on(tmp_path: Path) -> None:
    proc, ranks = _start_job(tmp_path, "--after-usr1-s", "1.5")
    try:
        proc.send_signal(signal.SIGUSR1)
    finally:
        [(code, _, err)] = finish([proc], 40)
    assert code == 0, err
    for rank in (0, 1):
        assert _received(tmp_path, f"rank{rank}") == ["SIGUSR1"]
        assert (tmp_path / f"done-rank{rank}").exists(), "the job was stopped instead of going on"
        assert _received(tmp_path, f"child{rank}") == [], "a rank's subprocess got the warning"
    assert "received SIGUSR1; passed it on to 2 rank(s)" in err
    wait_dead(_all_pids(ranks), timeout=5)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_sigterm_gives_the_ranks_time_to_save_and_the_job_ends_with_their_status(tmp_path: Path) -> None:
    """The save takes 3 s, twice the grace of a stopped job: the ranks must be left alone meanwhile."""
    proc, ranks = _start_job(tmp_path, "--save-s", "3", "--exit-code", "0")
    try:
        proc.send_signal(signal.SIGTERM)
    finally:
        [(code, _, err)] = finish([proc], 40)
    assert code == 0, err
    for rank in (0, 1):
        assert (tmp_path / f"saved-rank{rank}").exists()
        assert _received(tmp_path, f"rank{rank}") == ["SIGTERM"]
        assert _received(tmp_path, f"child{rank}") == []
    assert f"waiting up to {SHUTDOWN_TIMEOUT_S:g} s" in err
    wait_dead(_all_pids(ranks), timeout=5)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_the_status_after_sigterm_is_the_ranks_and_a_warning_is_never_restarted(tmp_path: Path) -> None:
    proc, ranks = _start_job(tmp_path, "--exit-code", "3", options=("--max-restarts", "2"))
    try:
        proc.send_signal(signal.SIGTERM)
    finally:
        [(code, _, err)] = finish([proc], 40)
    assert code == 3, err
    assert "rank 0 exited with code 3" in err or "rank 1 exited with code 3" in err
    assert "restarting" not in err, "the ranks ended because they were told to: no restart"
    wait_dead(_all_pids(ranks), timeout=5)


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_ranks_that_ignore_sigterm_are_stopped_after_the_shutdown_timeout(tmp_path: Path) -> None:
    proc, ranks = _start_job(tmp_path, "--on-term", "ignore", options=("--shutdown-timeout", "2"))
    sent = time.monotonic()
    try:
        proc.send_signal(signal.SIGTERM)
    finally:
        [(code, _, err)] = finish([proc], 40)
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, err
    assert "the ranks did not end within 2 s of SIGTERM; stopping 2 rank(s)" in err
    assert 2 <= took < 15, took  # 2 s of patience, the stop's grace (1.5 s), and a loaded machine
    wait_dead(_all_pids(ranks), timeout=5)


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_sigterm_or_ctrl_c_during_the_wait_stops_the_job_at_once(tmp_path: Path, second: int) -> None:
    proc, ranks = _start_job(tmp_path, "--on-term", "ignore")
    try:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _received(tmp_path, "rank0") != ["SIGTERM"] or _received(tmp_path, "rank1") != ["SIGTERM"]:
            assert time.monotonic() < deadline, "the ranks did not get the first SIGTERM"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(second)
    finally:
        [(code, _, err)] = finish([proc], 40)
    took = time.monotonic() - sent
    assert code == 128 + second, err
    reason = "received SIGTERM again" if second == signal.SIGTERM else "received SIGINT"
    assert f"{reason}; stopping 2 rank(s)" in err
    assert took < 10, took  # not the 30 s shutdown timeout
    wait_dead(_all_pids(ranks), timeout=5)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_ranks_that_do_not_listen_die_of_sigterm_as_under_srun(tmp_path: Path) -> None:
    """A script that never reads ``fabric.preempted`` keeps SIGTERM's default action: the job ends at once."""
    proc, ranks = _start_job(tmp_path, "--sleep", "60", options=("--max-restarts", "2"), script=RANKS_ENV)
    try:
        proc.send_signal(signal.SIGTERM)
    finally:
        [(code, _, err)] = finish([proc], 20)
    assert code == 128 + signal.SIGTERM, err
    assert "was killed by SIGTERM" in err
    assert "restarting" not in err, "a pre-emption warning is no failure worth a restart"
    wait_dead([record["pid"] for record in ranks.values()], timeout=5)


# ---- the policy and the pipe, in this process ------------------------------------------------------


def test_the_policy_forwards_sigterm_once_then_stops_and_says_why() -> None:
    said: list[str] = []
    policy = SignalForwarding(shutdown_timeout=0.2, report=said.append)
    assert policy.stops_job(signal.SIGUSR1, []) is False and policy.forwarded == signal.SIGUSR1
    assert policy.stops_job(signal.SIGTERM, []) is False and policy.forwarded == signal.SIGTERM
    assert policy.stops_job(signal.SIGUSR1, []) is False and policy.forwarded == signal.SIGTERM  # SIGTERM stays
    assert not policy.overdue()
    assert policy.stop_reason(signal.SIGTERM) == "received SIGTERM again"
    assert policy.stops_job(signal.SIGTERM, []) is True
    assert policy.stops_job(signal.SIGINT, []) is True
    time.sleep(0.25)
    assert policy.overdue() and policy.stop_reason(signal.SIGTERM) == "the ranks did not end within 0.2 s of SIGTERM"
    assert len(said) == 3 and "passed it on to 0 rank(s)" in said[0]
    policy.reset()
    assert policy.forwarded is None and not policy.overdue() and policy.stops_job(signal.SIGTERM, []) is False


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_bad_shutdown_timeout_is_refused_naming_it(bad: float) -> None:
    with pytest.raises(ValueError, match=r"shutdown_timeout=.*accepted: a number of seconds >= 0"):
        SignalForwarding(shutdown_timeout=bad)


def test_the_signal_pipe_keeps_every_delivery_in_order() -> None:
    """Two signals that arrive between two looks are both taken: a second SIGTERM is never lost."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    pipe = SignalPipe([signal.SIGUSR1, signal.SIGUSR2])
    try:
        assert pipe.fd is not None
        for signum in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGUSR2):
            signal.raise_signal(signum)
        assert [pipe.take(), pipe.take(), pipe.take(), pipe.take()] == [signal.SIGUSR2, signal.SIGUSR1, signal.SIGUSR2, None]
    finally:
        pipe.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
