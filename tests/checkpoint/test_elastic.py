"""Elastic jobs: ``--num-nodes MIN:MAX``. A node lost for good leaves the job to the nodes that are left, a
node that joins later is taken at the next round, and every sample of the epoch is used exactly once.

Two "nodes" are two launchers of 2 CPU ranks each on this machine (``fabric-torch run`` or torchrun).
The job (``support/scripts/resize/elastic_job.py``) saves after every step and loads its checkpoint
when there is one, knowing nothing of the number of processes: the resume on another world size is
the ordinary exact-resume recipe. A node is lost "for good" as a machine is: its launcher and every
process under it are killed with SIGKILL at once, and it does not come back. The rendezvous settings
are shortened (``last_call_timeout=1``, a node silent for 5 s is gone) to keep the tests quick, so they are
``timing`` tests: beside other tests on two cores a live node's keep-alive can miss that window, so they run
alone. The launchers
start fresh; under ``fabric-torch run`` the ranks run warm (the subject is what the launchers do when a node goes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support import PYTHON
from support.environment import clean_env, free_port
from support.loading import script_path
from support.processes import fabric_run, finish, start

JOB = script_path("resize", "elastic_job.py")
SAMPLES = 64  # the job's dataset: ids 0..63, batches of 2 per rank
QUICK_RENDEZVOUS = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"

pytestmark = [pytest.mark.timing, pytest.mark.procs, pytest.mark.usefixtures("clean_fabric_env")]


def _node(out: Path, port: int, node_rank: int, *options: object, **env: str) -> subprocess.Popen:
    return start(fabric_run("--accelerator", "cpu", "--devices", 2, "--num-nodes", "1:2", "--node-rank", node_rank,
                            "--main-port", port, "--rdzv-conf", QUICK_RENDEZVOUS, *options, JOB, out),
                 env=clean_env(OMP_NUM_THREADS="1", **env))


def _saved_step(out: Path) -> int:
    try:
        return int((out / "saved").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _wait_for_saved_step(out: Path, step: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _saved_step(out) < step:
        if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
            for proc in procs:
                proc.kill()
            tails = "\n".join(f"launcher {i} (exit {proc.returncode}):\n{proc.communicate()[1][-3000:]}"
                              for i, proc in enumerate(procs))
            raise AssertionError(f"the job did not save step {step} within {timeout} s:\n{tails}")
        time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _lose_machine(proc: subprocess.Popen) -> None:
    """Kill a launcher and every process under it at once, as when its machine goes away."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(out: Path, world_size: int) -> list[dict]:
    return [json.loads(path.read_text()) | {"step": int(path.stem.rsplit("step", 1)[1]), "file": path.name}
            for path in out.glob(f"w{world_size}-*.json")]


def assert_every_sample_once(out: Path, before: int, after: int) -> int:
    """The ids trained on by ``before`` ranks up to the checkpoint the ``after`` ranks resumed from, and by the
    ``after`` ranks from there to the end, are the dataset exactly once; returns the step resumed from."""
    resumed = _records(out, after)
    assert resumed, f"no step ran on {after} ranks: {sorted(p.name for p in out.iterdir())}"
    starts = {record["resumed_at"] for record in resumed}
    assert len(starts) == 1 and starts.pop() > 0, f"the {after} ranks did not resume from one checkpoint: {starts}"
    resumed_at = resumed[0]["resumed_at"]
    first = [record for record in _records(out, before) if record["step"] <= resumed_at]
    assert len(first) == before * resumed_at, f"expected {before} ranks x {resumed_at} steps before the resize"
    used = sorted(i for record in first + resumed for i in record["ids"])
    assert used == list(range(SAMPLES)), "over the epoch every sample must be used exactly once"
    assert {record["world_size"] for record in resumed} == {after}
    return int(resumed_at)


@pytest.mark.timeout(240)
def test_a_node_lost_for_good_leaves_the_job_to_the_other_node(tmp_path: Path) -> None:
    port = free_port()
    nodes = [_node(tmp_path, port, 0, "--max-restarts", 1), _node(tmp_path, port, 1, "--max-restarts", 1)]
    _wait_for_saved_step(tmp_path, 2, nodes)
    _lose_machine(nodes[1])
    (code0, _out0, err0), (code1, _, _) = finish(nodes, 180)
    assert code1 == -signal.SIGKILL
    assert code0 == 0, err0[-4000:]
    assert "restart 1 of 1" in err0, err0[-3000:]
    resumed_at = assert_every_sample_once(tmp_path, before=4, after=2)
    # the surviving node's two ranks ran the rest of the epoch as the job's ranks 0 and 1, after one restart
    assert {r["file"].split("-step")[0] for r in _records(tmp_path, 2)} == {"w2-a1-rank0", "w2-a1-rank1"}
    assert max(r["step"] for r in _records(tmp_path, 2)) == resumed_at + (SAMPLES - 8 * resumed_at) // 4


@pytest.mark.timeout(240)
def test_a_node_that_joins_later_is_taken_at_the_next_round(tmp_path: Path) -> None:
    """Node 0 starts alone (MIN is 1); node 1 joins mid-epoch: both go on together, no restart used up. Node 0's ranks
    wait after step 2 while they are 2, so the join lands mid-epoch however slowly node 1 starts (on a loaded machine
    node 0 had finished the epoch alone before node 1's agent joined)."""
    port = free_port()
    first = _node(tmp_path, port, 0, ELASTIC_HOLD="2:4")
    _wait_for_saved_step(tmp_path, 2, [first])
    second = _node(tmp_path, port, 1, ELASTIC_HOLD="2:4")
    (code0, _, err0), (code1, _, err1) = finish([first, second], 180)
    assert (code0, code1) == (0, 0), f"node 0:\n{err0[-4000:]}\nnode 1:\n{err1[-4000:]}"
    assert_every_sample_once(tmp_path, before=2, after=4)
    # a node joining is no failure: TORCHELASTIC_RESTART_COUNT stays 0 and --max-restarts 0 is enough
    assert {r["file"].split("-rank")[0] for r in _records(tmp_path, 4)} == {"w4-a0"}


@pytest.mark.cold  # torchrun's agents, warm ranks: the surviving agent never ended its restarted workers (tried once)
@pytest.mark.timeout(240)
def test_torchrun_with_a_node_range_goes_on_without_a_lost_node(tmp_path: Path) -> None:
    port = free_port()
    agents = []
    # On one machine both agents match the endpoint's host, and torchrun makes whichever binds the port first
    # the store's host: if that was the second agent, losing it took the store from the survivor. As on two
    # machines, the first agent hosts the store and the second (the one lost) is only its client.
    for is_host in (1, 0):
        agents.append(start([PYTHON, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
                             "--rdzv-conf", f"{QUICK_RENDEZVOUS},is_host={is_host}", "--max-restarts", "1",
                             "--monitor-interval", "0.2", str(JOB), str(tmp_path)], env=clean_env(OMP_NUM_THREADS="1")))
    _wait_for_saved_step(tmp_path, 2, agents)
    _lose_machine(agents[1])
    (code0, _, err0), (code1, _, _) = finish(agents, 180)
    assert code1 == -signal.SIGKILL
    assert code0 == 0, err0[-4000:]
    assert_every_sample_once(tmp_path, before=4, after=2)
