"""Restart and resume: a rank is killed mid-epoch, the launcher starts the job again, the job resumes
from its latest checkpoint and ends bit-identical to a run that was never interrupted, under
``fabric run --max-restarts`` and ``torchrun --max-restarts``.

Real processes: ``support/scripts/resilience/keep_going_job.py`` (2 ranks, a checkpoint every 3 steps) whose
rank 1 kills itself with SIGKILL before step 8 in the first attempt. Under ``torchrun --max-restarts 1``
(static and c10d rendezvous) the second attempt must form its process group (DDPStrategy rendezvouses
under a store prefix of its own per attempt), load step 6 and finish.

With several nodes (two ``fabric run`` processes of 2 ranks each on this machine, ``--num-nodes 2``)
the nodes meet in torch's elastic rendezvous and restart together: rank 3 (node 1) dies, both nodes
start attempt 1 and the job ends as an uninterrupted 4-rank run; when the restarts are spent, or a
node gets a signal, every node ends, none hangs.

The restarted jobs' ranks are fresh interpreters (which rank the launcher sees end first is the subject);
the uninterrupted reference runs are warm (``warm_ranks_env``).
"""

from __future__ import annotations

import json
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from support import PYTHON
from support.environment import clean_env, free_port
from support.loading import script_path
from support.processes import fabric_run, finish, run, start, wait_for_files

JOB = script_path("resilience", "keep_going_job.py")
ATTEMPT_RANK = script_path("resilience", "elastic_attempt_rank.py")
NODE_ATTEMPTS = script_path("resilience", "node_attempts.py")
TOTAL_STEPS = 16  # 2 epochs of 64 samples in batches of 4 per rank, on 2 ranks (8 on 4 ranks)
DIE_AT = 7  # rank 1 dies before its 8th step: the last checkpoint is step 6

pytestmark = [pytest.mark.procs, pytest.mark.cold, pytest.mark.usefixtures("clean_fabric_env")]


def _final(folder, rank: int) -> dict:
    return torch.load(folder / f"final-rank{rank}.pt", weights_only=True)


@pytest.fixture
def uninterrupted(keep_going_uninterrupted):
    return keep_going_uninterrupted


def assert_resumed_exactly(folder, reference, ranks: int = 2, died: int = 1) -> None:
    total_steps = TOTAL_STEPS * 2 // ranks
    for rank in range(ranks):
        resumed, expected = _final(folder, rank), _final(reference, rank)
        assert resumed["attempt"] == 1, "the job should have finished in its second attempt"
        assert resumed["resumed_from"] == 6, "the second attempt should resume from the step-6 checkpoint"
        assert resumed["trained"] == list(range(7, total_steps + 1))
        for name, value in expected["params"].items():
            assert torch.equal(resumed["params"][name], value), f"rank {rank}: {name} differs from the uninterrupted run"
    # the first attempt really died where it should have, and the second one finished
    assert int((folder / f"progress-rank{died}").read_text()) == total_steps
    assert (folder / f"pid-attempt0-rank{died}").exists() and (folder / f"pid-attempt1-rank{died}").exists()


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
def uninterrupted_fsdp(tmp_path_factory, warm_ranks_env):
    folder = tmp_path_factory.mktemp("uninterrupted_fsdp")
    command = [PYTHON, str(JOB), str(folder), "--strategy", "fsdp"]
    [(code, out, err)] = finish([start(command, env=clean_env(OMP_NUM_THREADS="1", **warm_ranks_env))], 150)
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


def test_a_rendezvous_id_without_the_nodes_rendezvous_is_refused(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("")
    result = run(fabric_run("--num-nodes", 2, "--rdzv-id", "job7", script), timeout=60, check=False)
    assert result.returncode == 2
    assert "--rdzv-id='job7' is not used here" in result.stderr and "--max-restarts >= 1" in result.stderr


# ---- several nodes ------------------------------------------------------------------------------------


def _two_nodes(options: list, script_and_args: list, **env: str) -> list:
    """Two `fabric run` processes of 2 CPU ranks each on this machine: node ranks 0 and 1 of one job."""
    port = free_port()
    return [start(fabric_run("--accelerator", "cpu", "--devices", 2, "--num-nodes", 2, "--node-rank", node,
                             "--main-port", port, *options, *script_and_args), env=clean_env(OMP_NUM_THREADS="1", **env))
            for node in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted_on_two_nodes(tmp_path_factory, warm_ranks_env):
    folder = tmp_path_factory.mktemp("uninterrupted_two_nodes")
    for code, out, err in finish(_two_nodes([], [JOB, folder, "--fixed-buckets"], **warm_ranks_env), 150):
        assert code == 0, f"{out}\n{err[-4000:]}"
    return folder


@pytest.mark.timeout(400)
def test_two_nodes_restart_together_and_the_job_resumes_exactly(tmp_path, uninterrupted_on_two_nodes) -> None:
    """Rank 3 (node 1) is killed mid-epoch: both nodes restart, the job resumes from step 6 and ends exactly.

    On 4 ranks the job keeps DDP's first gradient buckets (see keep_going_job.py): bit-exactness then
    holds; the restart itself is what this test is about.
    """
    nodes = _two_nodes(["--max-restarts", 1], [JOB, tmp_path, "--die-rank", 3, "--die-at", DIE_AT, "--fixed-buckets"])
    (code0, _out0, err0), (code1, _out1, err1) = finish(nodes, 300)
    assert (code0, code1) == (0, 0), f"node 0:\n{err0[-4000:]}\nnode 1:\n{err1[-4000:]}"
    assert "rank 3 was killed by SIGKILL" in err1, err1[-3000:]
    assert "restart 1 of 1" in err1 and "restart 2" not in err1, err1[-3000:]
    # node 0's ranks fail too (their peer died), or node 0 is stopped for node 1's round first
    assert ("restart 1 of 1" in err0 or "again with the nodes of the next round" in err0) and "restart 2" not in err0, err0[-3000:]
    assert_resumed_exactly(tmp_path, uninterrupted_on_two_nodes, ranks=4, died=3)
    # every rank ran in both attempts, and saw TORCHELASTIC_RESTART_COUNT 0, then 1
    pids = {path.name for path in tmp_path.glob("pid-attempt*")}
    assert pids == {f"pid-attempt{attempt}-rank{rank}" for attempt in (0, 1) for rank in range(4)}, pids


def _attempts(folder) -> dict[tuple[int, int], dict]:
    """(attempt, rank) -> the rank variables that rank saw, from node_attempts.py's records."""
    records = {}
    for path in folder.glob("attempt*-rank*.json"):
        attempt, rank = path.stem.removeprefix("attempt").split("-rank")
        records[int(attempt), int(rank)] = json.loads(path.read_text())
    return records


@pytest.mark.timeout(200)
def test_two_nodes_give_up_together_when_the_restarts_are_spent(tmp_path) -> None:
    """Rank 3 fails in every attempt; node 0's ranks never fail, node 0 restarts because node 1 does."""
    started = time.monotonic()
    nodes = _two_nodes(["--max-restarts", 1], [NODE_ATTEMPTS, tmp_path, "--fail-rank", 3])
    (code0, _, err0), (code1, _, err1) = finish(nodes, 150)
    assert code1 == 3, err1[-3000:]  # the failed rank's status, on its node
    assert code0 != 0, err0[-3000:]
    assert time.monotonic() - started < 120
    assert "another node is restarting the job" in err0 and "another node ended the job" in err0, err0[-3000:]
    records = _attempts(tmp_path)
    assert set(records) == {(attempt, rank) for attempt in (0, 1) for rank in range(4)}, sorted(records)
    for (attempt, rank), seen in records.items():
        assert seen["TORCHELASTIC_RESTART_COUNT"] == str(attempt) and seen["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert seen["GROUP_RANK"] == str(rank // 2) and seen["WORLD_SIZE"] == "4"
    # one rendezvous port for the ranks per attempt, the same on both nodes, a new one for the restart
    ports = [{records[attempt, rank]["MASTER_PORT"] for rank in range(4)} for attempt in (0, 1)]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1], ports
    assert len({seen["TORCHELASTIC_RUN_ID"] for seen in records.values()}) == 1


@pytest.mark.timeout(200)
def test_a_signal_to_one_node_ends_every_node_without_a_restart(tmp_path) -> None:
    nodes = _two_nodes(["--max-restarts", 1], [NODE_ATTEMPTS, tmp_path])
    wait_for_files(tmp_path, "attempt0-rank*.json", 4, timeout=120)
    nodes[0].send_signal(signal.SIGINT)  # Ctrl-C: stops the job at once (SIGTERM may be a pre-emption warning)
    (code0, _, err0), (code1, _, err1) = finish(nodes, 60)
    assert code0 == 128 + signal.SIGINT, err0[-3000:]
    assert code1 != 0 and "another node ended the job" in err1, err1[-3000:]
    assert not list(tmp_path.glob("attempt1-*")), "a signal must never restart the job"


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


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_a_node_waiting_for_the_others_ends_at_once_on_a_signal(tmp_path) -> None:
    """Node 1 alone (node 0 never comes): it waits in the rendezvous, yet Ctrl-C ends it within seconds."""
    lone = start(fabric_run("--devices", 2, "--num-nodes", 2, "--node-rank", 1, "--main-port", free_port(),
                            "--max-restarts", 1, NODE_ATTEMPTS, tmp_path), env=clean_env(OMP_NUM_THREADS="1"))
    time.sleep(4)  # started, its signal handling installed, waiting for node 0's store
    assert lone.poll() is None
    signalled = time.monotonic()
    lone.send_signal(signal.SIGINT)
    [(code, _, err)] = finish([lone], 60)
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert time.monotonic() - signalled < 10
    assert "received SIGINT while waiting for the other nodes" in err, err[-3000:]
    assert not list(tmp_path.glob("attempt*")), "no rank starts before every node joined"


@pytest.mark.timeout(150)
def test_nodes_given_the_same_node_rank_are_told_so_and_end(tmp_path) -> None:
    port = free_port()
    nodes = [start(fabric_run("--devices", 1, "--num-nodes", 3, "--node-rank", node, "--main-port", port,
                              "--max-restarts", 1, NODE_ATTEMPTS, tmp_path), env=clean_env(OMP_NUM_THREADS="1"))
             for node in (0, 1, 1)]
    for code, _, err in finish(nodes, 120):
        assert code == 1, err[-3000:]
        assert "the nodes joined with --node-rank values [0, 1, 1]; each of the 3 nodes needs its own" in err, err
    assert not list(tmp_path.glob("attempt*")), "no rank starts in a job whose nodes disagree"
