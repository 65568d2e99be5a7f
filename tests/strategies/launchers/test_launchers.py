"""Launchers start real processes here: every test is about what actually happens to them.

The scripts in ``support/scripts/launchers/`` run a small job with a stand-in cluster
environment/strategy. Each rank writes its pid (and its grandchild's pid) to a JSON
file so the tests can check that nothing of the job survives a failure, and the
failing rank writes a timestamp so the tests can check how fast the job ended.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the launcher process tests inspect /proc", allow_module_level=True)

from fabric.strategies.launchers import (
    Launcher,
    MultiprocessingLauncher,
    RankFailedError,
    SubprocessScriptLauncher,
)
from fabric.supervision.rank_side import label_lines
from fabric.supervision.supervisor import describe_exit
from support import REPO, TESTS
from support.environment import clean_env, is_job_variable
from support.loading import script_path
from support.processes import alive
from support.scripts.launchers.standin import StandInEnvironment, StandInStrategy

pytestmark = pytest.mark.cold

# The promise under test: after any failure the whole job is gone within this many seconds.
FAIL_FAST_S = 5.0


def _wait_all_dead(pids: list[int], timeout: float) -> float:
    """Time (time.time()) at which every pid was seen dead; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in pids if alive(p)]
        if not running:
            return time.time()
        if time.monotonic() > deadline:
            pytest.fail(f"processes still alive: {running}")
        time.sleep(0.02)


class Job:
    """A launcher script running as a subprocess, with its output in files."""

    def __init__(self, outdir: Path, proc: subprocess.Popen) -> None:
        self.outdir = outdir
        self.proc = proc
        self.end_time: float | None = None

    def ranks(self) -> dict[int, dict]:
        return {
            int(p.stem[4:]): json.loads(p.read_text()) for p in self.outdir.glob("rank*.json")
        }

    def wait_for_ranks(self, n: int, timeout: float = 30.0) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        while len(self.ranks()) < n:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"only ranks {sorted(self.ranks())} started; stderr:\n{self.stderr}")
            time.sleep(0.05)
        return self.ranks()

    def wait(self, timeout: float = 40.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not finish in {timeout}s; stderr:\n{self.stderr}")
        self.end_time = time.time()
        return rc

    def all_pids(self, include_grandchild_of: set[int] | None = None) -> list[int]:
        pids = []
        for rank, info in self.ranks().items():
            pids.append(info["pid"])
            if "grandchild" in info and (include_grandchild_of is None or rank in include_grandchild_of):
                pids.append(info["grandchild"])
        return pids

    @property
    def fail_time(self) -> float:
        return float((self.outdir / "fail_time").read_text())

    @property
    def stdout(self) -> str:
        return (self.outdir / "stdout.txt").read_text()

    @property
    def stderr(self) -> str:
        return (self.outdir / "stderr.txt").read_text()


@pytest.fixture
def run_job(tmp_path):
    """Start a launcher script; at teardown SIGKILL whatever the test left behind."""
    jobs: list[Job] = []

    def start(script: str, *args: str, module: bool = False) -> Job:
        outdir = tmp_path / f"job{len(jobs)}"
        outdir.mkdir()
        env = clean_env()
        if module:
            cmd = [sys.executable, "-m", f"support.scripts.launchers.{script}"]
            cwd = TESTS
        else:
            cmd = [sys.executable, str(script_path("launchers", f"{script}.py"))]
            cwd = REPO
        with open(outdir / "stdout.txt", "wb") as out, open(outdir / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(
                [*cmd, "--outdir", str(outdir), *args],
                cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        job = Job(outdir, proc)
        jobs.append(job)
        return job

    yield start

    for job in jobs:
        for pid in [job.proc.pid, *job.all_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:  # the session the test gave the launcher: anything of rank 0 left in it
            os.killpg(job.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        job.proc.wait()


@pytest.fixture
def clean_environ():
    saved = dict(os.environ)
    for key in [key for key in os.environ if is_job_variable(key)]:
        del os.environ[key]
    yield
    os.environ.clear()
    os.environ.update(saved)


# --------------------------------------------------------------------------------------
# popen: SubprocessScriptLauncher
# --------------------------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_starts_ranks_with_shared_env_and_waits_for_them(run_job):
    job = run_job("popen_job", "--nprocs", "3", "--linger", "1.0")
    assert job.wait() == 0, job.stderr
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1, 2]
    # Rank 0 returned well before ranks 1 and 2; the launcher still waited for them.
    for rank in range(3):
        assert (job.outdir / f"done{rank}").exists()
    done = {r: float((job.outdir / f"done{r}").read_text()) for r in range(3)}
    assert done[0] < done[1] <= job.end_time and done[2] <= job.end_time

    port = ranks[0]["env"]["MASTER_PORT"]
    assert port and port.isdigit()
    for rank in (1, 2):
        env = ranks[rank]["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == port
        assert env["FABRIC_PARENT_PID"] == str(ranks[0]["pid"])
        assert ranks[rank]["argv"][1:] == ranks[0]["argv"][1:]
        assert ranks[rank]["cwd"] == ranks[0]["cwd"]
        assert ranks[rank]["pgid"] == ranks[rank]["pid"]  # own process group
    # Rank 0 keeps its own identity, but knows the shared address.
    assert ranks[0]["env"]["LOCAL_RANK"] is None and ranks[0]["env"]["RANK"] is None
    assert ranks[0]["env"]["NODE_RANK"] == "0"
    assert sorted(line for line in job.stdout.splitlines()) == [f"rank {r} returned" for r in range(3)]
    _wait_all_dead(job.all_pids(), timeout=2)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_forks_of_rank0_do_not_act_for_the_job(run_job):
    job = run_job("popen_job", "--nprocs", "2", "--fork-noise", "--linger", "0.5")
    assert job.wait() == 0, job.stderr
    assert (job.outdir / "done1").exists()
    assert "an exception in a forked copy of rank 0" in job.stderr  # reported as usual
    assert "[fabric]" not in job.stderr  # but the job was not stopped


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_reruns_python_dash_m(run_job):
    job = run_job("popen_job", "--nprocs", "2", module=True)
    assert job.wait() == 0, job.stderr
    ranks = job.ranks()
    assert ranks[0]["main_spec"] == ranks[1]["main_spec"] == "support.scripts.launchers.popen_job"
    assert ranks[1]["cwd"] == str(TESTS)


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("exception", "rank 1 raised ValueError"),
        ("sigkill", "rank 1 was killed by SIGKILL"),
        ("exit", "rank 1 exited with code 3"),
    ],
)
@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
def test_popen_child_failure_ends_the_job(run_job, how, expected):
    nprocs = 3 if how == "exception" else 2  # keep the run time down on small CI machines
    job = run_job(
        "popen_job", "--nprocs", str(nprocs), "--fail-rank", "1", "--how", how, "--block", "--grandchild"
    )
    rc = job.wait()
    assert rc != 0
    gone = _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    assert gone - job.fail_time < FAIL_FAST_S
    assert job.end_time - job.fail_time < FAIL_FAST_S
    assert len(job.ranks()) == nprocs
    stderr = job.stderr
    assert stderr.count(expected) == 1, stderr
    if how == "exception":  # one brief report, by the supervisor (rank 0), with the rank's own frame
        assert "Traceback (most recent call last)" not in stderr, stderr
        assert stderr.count("ValueError: boom from rank 1") == 1, stderr
        assert 'ranks.py", line' in stderr and "FABRIC_FULL_TRACEBACKS=1" in stderr


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_blames_the_dead_rank_not_its_echoes(run_job):
    """Peers of a killed rank fail right after it; the report must name the killed one."""
    job = run_job("popen_job", "--nprocs", "3", "--fail-rank", "1", "--how", "sigkill", "--echo", "--grandchild")
    assert job.wait() != 0
    _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    reports = [line for line in job.stderr.splitlines() if line.startswith("[fabric]")]
    assert len(reports) == 1 and "rank 1 was killed by SIGKILL" in reports[0], job.stderr


@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_child_failure_after_rank0_returned(run_job):
    """Rank 0 is already waiting at exit when rank 1 fails: the job must still fail."""
    job = run_job("popen_job", "--nprocs", "2", "--fail-rank", "1", "--fail-after", "1.0")
    assert job.wait() != 0
    assert (job.outdir / "done0").exists()
    assert job.end_time - job.fail_time < FAIL_FAST_S
    assert job.stderr.count("ValueError: boom from rank 1") == 1


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_counts_only_the_ranks_still_running_as_the_others(run_job):
    """Rank 2 has finished and rank 0 waits at exit when rank 1 raises: one other rank (rank 0) is stopped."""
    job = run_job("popen_job", "--nprocs", "3", "--fail-rank", "1", "--fail-after", "2.0")
    assert job.wait() == 1, job.stderr
    assert (job.outdir / "done2").exists()
    reports = [line for line in job.stderr.splitlines() if line.startswith("[fabric]")]
    assert len(reports) == 1 and "rank 1 raised ValueError" in reports[0], job.stderr
    assert reports[0].endswith("; stopping the other 1 rank(s) on this node"), job.stderr


@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exception", "sysexit"])
def test_popen_rank0_failure_kills_children(run_job, how):
    job = run_job("popen_job", "--nprocs", "2", "--fail-rank", "0", "--how", how, "--block", "--grandchild")
    rc = job.wait()
    assert rc == (1 if how == "exception" else 3), job.stderr
    gone = _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    assert gone - job.fail_time < FAIL_FAST_S
    if how == "exception":
        assert "[fabric] rank 0 raised ValueError" in job.stderr, job.stderr
        assert job.stderr.count("ValueError: boom from rank 0") == 1, job.stderr


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_kill_called_by_the_strategy(run_job):
    job = run_job(
        "popen_job", "--nprocs", "2", "--fail-rank", "0", "--block", "--grandchild", "--strategy-kills"
    )
    assert job.wait() == 1
    assert "killed 1 children" in job.stdout
    _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    # rank 0's own error is the one report; the children it killed on purpose are no failure of theirs
    reports = [line for line in job.stderr.splitlines() if line.startswith("[fabric]")]
    assert len(reports) == 1 and reports[0].startswith("[fabric] rank 0 raised ValueError, pid"), job.stderr
    assert job.stderr.count("ValueError: boom from rank 0") == 1, job.stderr


@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_popen_rank0_sigkilled_children_stop_themselves(run_job):
    job = run_job("popen_job", "--nprocs", "3", "--block", "--grandchild")
    ranks = job.wait_for_ranks(3)
    killed_at = time.time()
    os.kill(ranks[0]["pid"], signal.SIGKILL)
    assert job.wait() == -signal.SIGKILL
    # Rank 0 had no chance to clean up; its children (and theirs) must go on their own.
    # (Rank 0's own `sleep` is orphaned: nobody is left who could know about it.)
    gone = _wait_all_dead(job.all_pids(include_grandchild_of={1, 2}), timeout=FAIL_FAST_S)
    assert gone - killed_at < FAIL_FAST_S
    assert "the launching process" in job.stderr


@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("signum", "codes"), [(signal.SIGINT, (130, -2)), (signal.SIGTERM, (143, -15))])
def test_popen_signal_to_launcher_tears_down_the_job(run_job, signum, codes):
    job = run_job("popen_job", "--nprocs", "2", "--block", "--grandchild")
    job.wait_for_ranks(2)
    sent_at = time.time()
    os.kill(job.proc.pid, signum)
    assert job.wait() in codes, job.stderr
    gone = _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    assert gone - sent_at < FAIL_FAST_S


@pytest.mark.timeout(30)
def test_popen_kill_method_and_single_process(clean_environ):
    # One process: nothing to start, the function just runs here.
    launcher = SubprocessScriptLauncher(StandInEnvironment(), num_processes=1, num_nodes=1)
    assert isinstance(launcher, Launcher)
    assert not launcher.is_interactive_compatible
    assert launcher.launch(lambda x, y=0: x + y, 2, y=3) == 5
    assert os.environ["MASTER_PORT"].isdigit()
    assert launcher.procs == []
    launcher.kill()  # nothing started: a no-op
    assert pickle.loads(pickle.dumps(launcher)).num_processes == 1
    with pytest.raises(ValueError, match="num_processes"):
        SubprocessScriptLauncher(StandInEnvironment(), num_processes=0, num_nodes=1)


@pytest.mark.timeout(30)
def test_popen_child_side_does_not_start_processes(clean_environ, monkeypatch):
    # A rank started by torchrun (LOCAL_RANK set, no marker of ours): run, start nothing.
    monkeypatch.setenv("LOCAL_RANK", "1")
    launcher = SubprocessScriptLauncher(StandInEnvironment(), num_processes=4, num_nodes=1)
    assert launcher.launch(lambda: "ran") == "ran"
    assert launcher.procs == []


# --------------------------------------------------------------------------------------
# spawn / fork / forkserver: MultiprocessingLauncher
# --------------------------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_spawn_returns_tensors_and_nested_structures(clean_environ):
    import torch

    from support.scripts.launchers import mp_funcs

    launcher = MultiprocessingLauncher(StandInStrategy(2), start_method="spawn")
    assert not launcher.is_interactive_compatible
    # A tensor argument: skipped by the pickling probe, shared with the workers by torch.
    result = launcher.launch(mp_funcs.return_structures, torch.tensor(2.0))
    assert result["rank"] == 0 and result["value"] == 42
    assert result["setup_idx"] == "0"  # setup_worker ran before the function
    assert result["master_port"] == os.environ["MASTER_PORT"]
    assert torch.equal(result["tensor"], torch.arange(4.0) * 2.0)
    assert torch.equal(result["nested"]["ones"], torch.ones(2, 2))
    assert torch.equal(result["nested"]["items"][0], torch.zeros(3, dtype=torch.int64))
    assert result["nested"]["items"][1] == "text"
    assert launcher.procs == []


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_fork_returns_a_cpu_tensor(clean_environ):
    import torch

    from support.scripts.launchers import mp_funcs

    launcher = MultiprocessingLauncher(StandInStrategy(2), start_method="fork")
    assert launcher.is_interactive_compatible
    assert torch.equal(launcher.launch(mp_funcs.return_tensor), torch.full((3,), 7.0))
    # fork pickles nothing, so even a local function works.
    assert launcher.launch(lambda: os.environ["RANK"]) == "0"


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_spawn_failure_raises_with_rank_and_traceback(clean_environ):
    from support.scripts.launchers import mp_funcs

    launcher = MultiprocessingLauncher(StandInStrategy(2), start_method="spawn")
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launcher.launch(mp_funcs.fail_on_rank, 1)
    assert time.monotonic() - start < 30  # rank 0 would sleep 60 s if it were not stopped
    err = info.value
    assert err.rank == 1
    message = str(err)
    assert message.startswith("rank 1 raised ValueError\nValueError: boom from rank 1\n")  # the brief report
    assert "fail_on_rank" in message and "FABRIC_FULL_TRACEBACKS=1" in message
    assert "[rank 1] Traceback (most recent call last)" in err.traceback_text  # the whole one, kept
    # The error survives pickling (e.g. when re-raised across processes).
    assert str(pickle.loads(pickle.dumps(err))) == message


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_multiprocessing_kill_from_another_thread(clean_environ):
    import threading

    from support.scripts.launchers import mp_funcs

    launcher = MultiprocessingLauncher(StandInStrategy(2), start_method="fork")
    timer = threading.Timer(1.0, launcher.kill)
    timer.start()
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="was killed by SIGTERM"):
        launcher.launch(mp_funcs.fail_on_rank, -1)  # every rank sleeps 60 s
    assert time.monotonic() - start < 10
    timer.join()


def _local_function() -> int:
    return 1


@pytest.mark.timing
@pytest.mark.timeout(30)
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_unpicklable_function_fails_before_starting_anything(clean_environ, start_method):
    def nested() -> None:
        pass

    import multiprocessing

    before = set(multiprocessing.active_children())  # (another test's worker may still be ending)
    launcher = MultiprocessingLauncher(StandInStrategy(2), start_method=start_method)
    for function in (lambda: None, nested):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="could not be pickled") as info:
            launcher.launch(function)
        message = str(info.value)
        assert "top level" in message and "fork" in message and "'ddp'" in message
        assert "pickl" in str(info.value.__cause__).lower() or "local object" in message
        assert time.monotonic() - start < 1.0
    assert launcher.procs == []
    assert set(multiprocessing.active_children()) <= before  # this launch started nothing
    # Arguments are checked as well.
    with pytest.raises(RuntimeError, match="arguments passed to launch"):
        launcher.launch(_local_function, lambda: None)


@pytest.mark.timeout(10)
def test_bad_start_method():
    with pytest.raises(ValueError, match=r"'bogus'.*'spawn', 'fork', 'forkserver'"):
        MultiprocessingLauncher(StandInStrategy(1), start_method="bogus")


@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
@pytest.mark.procs
@pytest.mark.timeout(60)
def test_fork_worker_killed_by_signal(run_job):
    # --echo: the other ranks raise the moment rank 1 is gone; rank 1 must still be blamed.
    job = run_job("mp_job", "--start-method", "fork", "--nprocs", "3", "--fail-rank", "1", "--how", "sigkill",
                  "--echo", "--grandchild")
    assert job.wait() == 1, job.stderr
    report = json.loads(job.stdout.strip().splitlines()[-1])
    assert report["rank"] == 1 and report["exitcode"] == -signal.SIGKILL
    assert report["message"] == "rank 1 was killed by SIGKILL"
    gone = _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    assert gone - job.fail_time < FAIL_FAST_S


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("start_method", "signum", "codes"),
    [("spawn", signal.SIGTERM, (143,)), ("fork", signal.SIGINT, (130, -2)), ("fork", signal.SIGKILL, (-9,))],
)
@pytest.mark.timing  # a bound on how fast a failing job is torn down: alone, not beside other tests
def test_multiprocessing_launcher_killed(run_job, start_method, signum, codes):
    job = run_job("mp_job", "--start-method", start_method, "--nprocs", "2", "--block", "--grandchild")
    job.wait_for_ranks(2)
    sent_at = time.time()
    os.kill(job.proc.pid, signum)
    assert job.wait() in codes, job.stderr
    gone = _wait_all_dead(job.all_pids(), timeout=FAIL_FAST_S)
    assert gone - sent_at < FAIL_FAST_S


# --------------------------------------------------------------------------------------
# Small pieces
# --------------------------------------------------------------------------------------


def test_exit_descriptions_and_labels():
    assert describe_exit(2, -signal.SIGKILL) == "rank 2 was killed by SIGKILL"
    assert describe_exit(0, 3) == "rank 0 exited with code 3"
    assert describe_exit(1, 1, raised=True) == "rank 1 raised an exception (exit code 1)"
    assert label_lines("a\nb\n", 3) == "[rank 3] a\n[rank 3] b\n"


def test_an_uncaught_rank_failure_ends_the_program_with_the_rank_status(monkeypatch):
    """What the multiprocessing launcher does before it raises: only an uncaught RankFailedError changes the status."""
    from fabric.strategies.launchers import multiprocessing as mp_launcher

    assert RankFailedError(1, 3).exit_status == 3
    assert RankFailedError(1, 0).exit_status == 1  # left while the others still needed it
    assert RankFailedError(1, -signal.SIGKILL).exit_status == 128 + signal.SIGKILL
    assert RankFailedError(1, 1, "Traceback ...").exit_status == 1
    shown = []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: shown.append(exc[0]))
    monkeypatch.delattr(sys, "ps1", raising=False)
    mp_launcher._end_with_the_rank_status_when_uncaught()
    mp_launcher._end_with_the_rank_status_when_uncaught()  # a second failed launch adds nothing
    with pytest.raises(SystemExit) as ended:
        sys.excepthook(RankFailedError, RankFailedError(1, 3), None)
    assert ended.value.code == 3 and shown == [RankFailedError]  # the traceback is shown first, once
    sys.excepthook(ValueError, ValueError("other"), None)  # any other error: Python's own status
    sys.excepthook(RankFailedError, RankFailedError(1, 1, "Traceback ..."), None)  # raised: 1 already
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    sys.excepthook(RankFailedError, RankFailedError(1, 3), None)  # a REPL goes on
    assert shown == [RankFailedError, ValueError, RankFailedError, RankFailedError]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_import_does_not_pull_in_torch():
    """The launcher modules themselves import only the standard library at module level."""
    # Bypass fabric/__init__ (which may import torch for its own reasons) with bare packages.
    code = (
        "import sys, types\n"
        "for name, path in (('fabric', 'fabric'), ('fabric.strategies', 'fabric/strategies')):\n"
        "    mod = types.ModuleType(name); mod.__path__ = [path]; sys.modules[name] = mod\n"
        "import fabric.strategies.launchers\n"
        "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(30)
def test_unpicklable_function_inside_a_partial_is_named(clean_environ):
    import functools

    def train_loop() -> None:
        pass

    launcher = MultiprocessingLauncher(StandInStrategy(2), start_method="spawn")
    assert launcher.requires_function
    with pytest.raises(RuntimeError, match=r"\(.*train_loop\) could not be pickled"):
        launcher.launch(functools.partial(_local_function, train_loop))
