"""Restart and resume: a rank is killed mid-epoch, the launcher starts the job again, the job resumes
from its latest checkpoint and ends bit-identical to a run that was never interrupted, under
``fabric run --max-restarts`` and ``torchrun --max-restarts``.

Real processes: ``support/scripts/resilience/keep_going_job.py`` (2 ranks, a checkpoint every 3 steps) whose
rank 1 kills itself with SIGKILL before step 8 in the first attempt. Under ``torchrun --max-restarts 1``
(static and c10d rendezvous) the second attempt must form its process group (DDPStrategy rendezvouses
under a store prefix of its own per attempt), load step 6 and finish.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from support import PYTHON
from support.environment import clean_env, free_port
from support.loading import script_path
from support.processes import fabric_run, finish, run, start

JOB = script_path("resilience", "keep_going_job.py")
ATTEMPT_RANK = script_path("resilience", "elastic_attempt_rank.py")
TOTAL_STEPS = 16
DIE_AT = 7  # rank 1 dies before its 8th step: the last checkpoint is step 6

pytestmark = pytest.mark.usefixtures("clean_fabric_env")


def _final(folder, rank: int) -> dict:
    return torch.load(folder / f"final-rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    [(code, out, err)] = finish([start([PYTHON, str(JOB), str(folder)], env=clean_env(OMP_NUM_THREADS="1"))], 150)
    assert code == 0, f"{out}\n{err[-4000:]}"
    return folder


def assert_resumed_exactly(folder, reference) -> None:
    for rank in range(2):
        resumed, expected = _final(folder, rank), _final(reference, rank)
        assert resumed["attempt"] == 1, "the job should have finished in its second attempt"
        assert resumed["resumed_from"] == 6, "the second attempt should resume from the step-6 checkpoint"
        assert resumed["trained"] == list(range(7, TOTAL_STEPS + 1))
        for name, value in expected["params"].items():
            assert torch.equal(resumed["params"][name], value), f"rank {rank}: {name} differs from the uninterrupted run"
    # the first attempt really died where it should have: rank 1 reached step 7 and no further
    assert int((folder / "progress-rank1").read_text()) == TOTAL_STEPS
    assert (folder / "pid-attempt0-rank1").exists() and (folder / "pid-attempt1-rank1").exists()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_restarts_a_killed_rank_and_the_job_resumes_exactly(tmp_path, uninterrupted, rendezvous) -> None:
    port = free_port()
    if rendezvous == "static":
        launch = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "keep-going"]
    command = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
               *launch, str(JOB), str(tmp_path), "--die-rank", "1", "--die-at", str(DIE_AT)]
    [(code, out, err)] = finish([start(command, env=clean_env(OMP_NUM_THREADS="1"))], 300)
    assert code == 0, f"torchrun exited with {code}:\n{out}\n{err[-6000:]}"
    assert "(exitcode: -9) local_rank: 1" in err, err[-3000:]  # torchrun saw rank 1 killed by SIGKILL
    assert_resumed_exactly(tmp_path, uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted_fsdp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted_fsdp")
    command = [PYTHON, str(JOB), str(folder), "--strategy", "fsdp"]
    [(code, out, err)] = finish([start(command, env=clean_env(OMP_NUM_THREADS="1"))], 150)
    assert code == 0, f"{out}\n{err[-4000:]}"
    return folder


@pytest.mark.timeout(400)
def test_torchrun_restarts_a_killed_fsdp_rank_and_the_sharded_job_resumes_exactly(tmp_path, uninterrupted_fsdp) -> None:
    """The sharded strategies rejoin a restarted attempt too, and resume from a folder of shards."""
    port = free_port()
    command = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "keep-going-fsdp",
               str(JOB), str(tmp_path), "--strategy", "fsdp", "--die-rank", "1", "--die-at", str(DIE_AT)]
    [(code, out, err)] = finish([start(command, env=clean_env(OMP_NUM_THREADS="1"))], 300)
    assert code == 0, f"torchrun exited with {code}:\n{out}\n{err[-6000:]}"
    assert "(exitcode: -9) local_rank: 1" in err, err[-3000:]
    assert (tmp_path / "checkpoints" / "step-00006.ckpt").is_dir(), "an fsdp checkpoint is a folder of shards"
    assert_resumed_exactly(tmp_path, uninterrupted_fsdp)


@pytest.mark.timeout(400)
def test_fabric_run_restarts_a_killed_rank_and_the_job_resumes_exactly(tmp_path, uninterrupted) -> None:
    command = fabric_run("--accelerator", "cpu", "--devices", 2, "--max-restarts", 1, JOB, tmp_path,
                         "--die-rank", 1, "--die-at", DIE_AT)
    [(code, out, err)] = finish([start(command, env=clean_env(OMP_NUM_THREADS="1"))], 300)
    assert code == 0, f"fabric run exited with {code}:\n{out}\n{err[-6000:]}"
    assert "rank 1 was killed by SIGKILL" in err and "restart 1 of 1" in err, err[-3000:]
    assert_resumed_exactly(tmp_path, uninterrupted)


@pytest.mark.timeout(200)
def test_fabric_run_gives_up_after_max_restarts(tmp_path) -> None:
    """A rank that dies in every attempt: N restarts, then the job fails with the rank's status."""
    script = tmp_path / "always_fails.py"
    script.write_text("import os, time\nrank = os.environ['RANK']\n"
                      "os.write(1, f\"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {rank}\\n\".encode())\n"
                      "raise SystemExit(3) if rank == '1' else time.sleep(60)\n")
    result = run(fabric_run("--devices", 2, "--max-restarts", 2, script), timeout=120, check=False)
    assert result.returncode == 3, result.stderr
    failing = [line for line in result.stdout.splitlines() if line.endswith("rank 1")]
    assert failing == ["attempt 0 rank 1", "attempt 1 rank 1", "attempt 2 rank 1"], result.stdout
    assert result.stderr.count("restarting the ranks") == 2


def test_max_restarts_with_several_nodes_is_refused(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("")
    result = run(fabric_run("--num-nodes", 2, "--max-restarts", 1, script), timeout=60, check=False)
    assert result.returncode == 2
    assert "--max-restarts=1 is not supported with --num-nodes=2" in result.stderr


def _attempt_rank(rank: int, attempt: int, port: int, timeout_s: float = 20):
    env = clean_env(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="attempts",
                    TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(attempt), OMP_NUM_THREADS="1")
    return start([PYTHON, str(ATTEMPT_RANK), str(timeout_s)], env=env)


@pytest.mark.timeout(200)
def test_a_restarted_attempt_never_reads_the_failed_attempts_addresses() -> None:
    """The agent's store outlives an attempt. The second attempt's rank 0 starts seconds before its rank 1:
    it must wait for rank 1's new address, not connect to the one attempt 0 left in the store."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    first = finish([_attempt_rank(r, 0, port) for r in (0, 1)], 90)
    assert [code for code, _, _ in first] == [0, 0], first
    rank0 = _attempt_rank(0, 1, port)
    time.sleep(3)  # attempt 0's rank 1 is gone; attempt 1's rank 1 is not there yet
    second = finish([rank0, _attempt_rank(1, 1, port)], 90)
    for code, out, err in second:
        assert code == 0 and "sum 3" in out, f"attempt 1 failed:\n{out}\n{err[-3000:]}"
    del agent_store
