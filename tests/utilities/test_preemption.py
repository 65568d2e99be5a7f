"""Pre-emption: the cluster warns (SIGUSR1, SIGTERM), every rank stops at the same step, saves, exits
cleanly; under SLURM the job is requeued and the requeued job resumes exactly.

Real processes and real signals: a 2-rank job (``support/scripts/resilience/keep_going_job.py``) under a
simulated ``srun`` (the SLURM variables each task gets, and a stand-in ``scontrol`` on PATH that
records its arguments) or under Fabric's own launcher. The signal goes to ONE rank; the collective
behind ``fabric.preempted`` must tell the other. Under ``fabric run`` the signal goes to the launcher,
as SLURM and Kubernetes send it, and `fabric run` passes it on to the ranks.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from support import PYTHON
from support.environment import clean_env, free_port
from support.loading import script_path
from support.processes import alive, fabric_run, finish, read_ranks, start, wait_dead, wait_for_files
from support.silent_store import silent_store

JOB = script_path("resilience", "keep_going_job.py")
HUNG = script_path("resilience", "hung_upload.py")
TOTAL_STEPS = 16  # 2 epochs x 8 steps per rank (64 samples, batch 4, 2 ranks)

pytestmark = [pytest.mark.cold, pytest.mark.usefixtures("clean_fabric_env")]


def _wait_for_step(folder: Path, rank: int, step: int, procs: list[subprocess.Popen], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    progress = folder / f"progress-rank{rank}"
    while time.monotonic() < deadline:
        if progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= step:
            return
        if any(p.poll() is not None for p in procs):
            outputs = [p.communicate() for p in procs]
            raise AssertionError(f"the job ended before step {step}: {outputs}")
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} did not reach step {step} within {timeout} s")


def _final_params(folder: Path, rank: int) -> dict:
    return torch.load(folder / f"final-rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(keep_going_uninterrupted) -> Path:
    """The reference: the same job, never interrupted (Fabric's own launcher, 2 ranks)."""
    folder = keep_going_uninterrupted
    for rank in range(2):
        assert _final_params(folder, rank)["trained"] == list(range(1, TOTAL_STEPS + 1))
    return folder


def _fake_scontrol(folder: Path) -> Path:
    """A stand-in ``scontrol`` that appends its arguments to ``scontrol.log`` and succeeds."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'scontrol.log'}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _srun_envs(folder: Path, bin_dir: Path, job_id: str, restart_count: int) -> list[dict[str, str]]:
    """What ``srun --ntasks 2`` on one node exports to each task (and PATH with the stand-in scontrol)."""
    port = str(free_port())
    common = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "keep_going", "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
              "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
              "SLURM_RESTART_COUNT": str(restart_count), "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return [clean_env(**common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0", PATH=path) for r in (0, 1)]


def _pid(folder: Path, rank: int, attempt: int = 0) -> int:
    path = folder / f"pid-attempt{attempt}-rank{rank}"
    return int(path.read_text())


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_sigusr1_under_slurm_stops_all_ranks_at_one_step_requeues_and_the_requeued_job_resumes_exactly(
    tmp_path: Path, uninterrupted: Path
) -> None:
    bin_dir = _fake_scontrol(tmp_path)
    command = [PYTHON, str(JOB), str(tmp_path), "--watch-preemption", "--pace", "0.3"]
    procs = [start(command, env=env) for env in _srun_envs(tmp_path, bin_dir, "4242", restart_count=0)]
    try:
        _wait_for_step(tmp_path, rank=1, step=4, procs=procs)
        os.kill(_pid(tmp_path, 1), signal.SIGUSR1)  # only rank 1 hears the warning
    finally:
        results = finish(procs, 120)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out}\n{err[-4000:]}"
    records = [json.loads((tmp_path / f"preempted-rank{r}.json").read_text()) for r in (0, 1)]
    assert records[0]["step"] == records[1]["step"], f"ranks stopped at different steps: {records}"
    stopped_at = records[0]["step"]
    assert 4 <= stopped_at < TOTAL_STEPS
    assert (tmp_path / "checkpoints" / f"step-{stopped_at:05d}.ckpt").exists()
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # once, by rank 0
    assert "requeued SLURM job 4242" in results[0][2]

    # SLURM starts the requeued job: same id, SLURM_RESTART_COUNT 1; it finds the checkpoint and finishes
    procs = [start([PYTHON, str(JOB), str(tmp_path), "--watch-preemption"], env=env)
             for env in _srun_envs(tmp_path, bin_dir, "4242", restart_count=1)]
    for rank, (code, out, err) in enumerate(finish(procs, 150)):
        assert code == 0, f"requeued rank {rank} exited with {code}:\n{out}\n{err[-4000:]}"
    _assert_final_params_match(tmp_path, uninterrupted, stopped_at)
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # not pre-empted again


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_sigterm_to_the_launching_process_stops_every_rank_cleanly_without_requeue(tmp_path: Path) -> None:
    """As Kubernetes does: SIGTERM to the container's main process only (here rank 0 of Fabric's launcher)."""
    bin_dir = _fake_scontrol(tmp_path)
    env = clean_env(OMP_NUM_THREADS="1", PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = start([PYTHON, str(JOB), str(tmp_path), "--watch-preemption", "--pace", "0.3"], env=env)
    try:
        _wait_for_step(tmp_path, rank=1, step=3, procs=[proc])
        proc.send_signal(signal.SIGTERM)
    finally:
        [(code, out, err)] = finish([proc], 120)
    assert code == 0, f"exited with {code}:\n{out}\n{err[-4000:]}"
    records = [json.loads((tmp_path / f"preempted-rank{r}.json").read_text()) for r in (0, 1)]
    assert records[0]["step"] == records[1]["step"], records
    assert (tmp_path / "checkpoints" / f"step-{records[0]['step']:05d}.ckpt").exists()
    assert not (tmp_path / "scontrol.log").exists(), "not a SLURM job: nothing to requeue"


def _assert_resumes_exactly(folder: Path, uninterrupted: Path, stopped_at: int, command: list[str]) -> None:
    """Run the job again from the checkpoint it left; it must end torch.equal to the uninterrupted run."""
    [(code, out, err)] = finish([start(command, env=clean_env(OMP_NUM_THREADS="1"))], 150)
    assert code == 0, f"the resumed job exited with {code}:\n{out}\n{err[-4000:]}"
    _assert_final_params_match(folder, uninterrupted, stopped_at)


def _assert_final_params_match(folder: Path, uninterrupted: Path, stopped_at: int) -> None:
    for rank in range(2):
        resumed, reference = _final_params(folder, rank), _final_params(uninterrupted, rank)
        assert resumed["resumed_from"] == stopped_at
        assert resumed["trained"] == list(range(stopped_at + 1, TOTAL_STEPS + 1))
        for name, value in reference["params"].items():
            assert torch.equal(resumed["params"][name], value), f"rank {rank}: {name} differs from the uninterrupted run"


@pytest.mark.procs
@pytest.mark.timeout(400)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_to_fabric_run_reaches_every_rank_which_stop_at_one_step_and_the_next_run_resumes_exactly(
    tmp_path: Path, uninterrupted: Path, signum: int
) -> None:
    """SLURM's ``--signal=USR1@90`` and Kubernetes' SIGTERM reach the launcher; the ranks save and exit 0."""
    command = fabric_run("--devices", "2", JOB, tmp_path)
    proc = start([*command, "--watch-preemption", "--pace", "0.3"], env=clean_env(OMP_NUM_THREADS="1"))
    try:
        _wait_for_step(tmp_path, rank=1, step=4, procs=[proc])
        proc.send_signal(signum)
    finally:
        [(code, out, err)] = finish([proc], 120)
    assert code == 0, f"fabric run exited with {code}:\n{out}\n{err[-4000:]}"
    assert f"received {signal.Signals(signum).name}; passed it on to 2 rank(s)" in err
    records = [json.loads((tmp_path / f"preempted-rank{r}.json").read_text()) for r in (0, 1)]
    assert records[0]["step"] == records[1]["step"], f"ranks stopped at different steps: {records}"
    stopped_at = records[0]["step"]
    assert 4 <= stopped_at < TOTAL_STEPS
    assert (tmp_path / "checkpoints" / f"step-{stopped_at:05d}.ckpt").exists()
    _assert_resumes_exactly(tmp_path, uninterrupted, stopped_at, command)


_ONE_PROCESS = textwrap.dedent(
    """
    import os, signal
    from fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=1)
    print("before", fabric.preempted)
    os.kill(os.getpid(), signal.{signal})
    os.kill(os.getpid(), signal.{signal})  # a repeat (launcher and scheduler both signal) changes nothing
    print("after", fabric.preempted, fabric.preempted)
    """
)


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_one_process_hears_the_signal_once_listening(name: str, subprocess_env) -> None:
    result = subprocess.run([sys.executable, "-c", _ONE_PROCESS.format(signal=name)], env=subprocess_env,
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["before", "False", "after", "True", "True"]


_TOLD_AGAIN = textwrap.dedent(
    """
    import os, signal, time
    from fabric import Fabric
    fabric = Fabric(accelerator="cpu", devices=1)
    assert not fabric.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same warning twice (scheduler and launcher): the process goes on
    time.sleep(0.5)
    print("warned", fabric.preempted, flush=True)
    time.sleep(1.5)
    os.kill(os.getpid(), signal.SIGTERM)  # later: told again, it ends
    time.sleep(30)
    print("not ended", flush=True)
    """
)


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_repeat_at_once_is_the_same_warning_and_a_later_sigterm_ends_the_process(subprocess_env) -> None:
    result = subprocess.run([sys.executable, "-c", _TOLD_AGAIN], env=subprocess_env, capture_output=True, text=True,
                            timeout=80)
    assert result.stdout.split() == ["warned", "True"], result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "rank 0 received SIGTERM again" in result.stderr


@pytest.mark.timing
@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["upload", "collective"])
def test_a_second_sigterm_ends_a_listening_rank_stuck_in_a_hung_upload_or_collective(tmp_path: Path, where: str) -> None:
    """The first SIGTERM is the warning (the rank goes on); a second one, later, ends it within seconds with 143.

    upload: one process, its main thread in an upload to a store that never answers. collective: rank 1 of a
    2-rank ``fabric run`` job, waiting in torch's C++ code for rank 0's outcome of that upload (a main thread there
    runs no Python signal handler); the job then ends with rank 1's status.
    """
    with silent_store() as store:
        env = clean_env(OMP_NUM_THREADS="1", **store)
        if where == "upload":
            proc, target = start([PYTHON, str(HUNG), str(tmp_path), "--hang", "save"], env=env), 0
        else:
            command = fabric_run("--devices", "2", HUNG, tmp_path, "--hang", "save")
            proc, target = start(command, env=env), 1
        try:
            wait_for_files(tmp_path, "rank*.json", 2 if where == "collective" else 1, timeout=150)
            pid = read_ranks(tmp_path)[target]["pid"]
            time.sleep(2)  # well inside the upload (or the collective)
            os.kill(pid, signal.SIGTERM)
            time.sleep(2)
            assert alive(pid), "the first SIGTERM is only the warning: the rank goes on"
            os.kill(pid, signal.SIGTERM)
            second = time.monotonic()
            wait_dead([pid], timeout=20)
            took = time.monotonic() - second
        except BaseException:  # nothing of the job outlives a failed test
            for pid in [proc.pid, *(rank["pid"] for rank in read_ranks(tmp_path).values())]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise
        finally:
            [(code, _, err)] = finish([proc], 60)
    assert took < 10, took  # a bounded flush (2 s) on a loaded machine
    assert code == 128 + signal.SIGTERM, err[-4000:]
    assert f"rank {target} received SIGTERM again" in err, err[-4000:]
    assert not list(tmp_path.glob("saved-rank*"))


def test_requeue_job_id_of_an_array_task(monkeypatch) -> None:
    from fabric.utilities.preemption import slurm_job_id

    monkeypatch.setenv("SLURM_JOB_ID", "1001")
    assert slurm_job_id() == "1001"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1000")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "1000_3"


def test_no_requeue_without_slurm_or_with_auto_requeue_off(monkeypatch) -> None:
    from types import SimpleNamespace

    from fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
    from fabric.utilities import preemption

    monkeypatch.setattr(preemption, "_REQUEUE_REGISTERED", False)
    for environment in (SLURMEnvironment(auto_requeue=False), LightningEnvironment()):
        preemption._requeue_at_exit_if_asked(SimpleNamespace(global_rank=0, cluster_environment=environment))
        assert preemption._REQUEUE_REGISTERED is False
