"""The same script on two "nodes": `fabric run --num-nodes 2`, torchrun, a simulated SLURM (srun), and
horovodrun; on loopback, and (where the machine allows) on two network namespaces with their own
addresses. Collectives must give world-wide results, and a few DDP steps must end with identical
replicas equal to the same training done in one process.

Each "node" is its own launch; torch.distributed (gloo) does all the communication.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from support import PYTHON
from support.environment import clean_env, free_port
from support.loading import script_path
from support.processes import fabric_run, finish, read_ranks, start, wait_dead

pytestmark = [pytest.mark.procs, pytest.mark.cold]

JOB = script_path("multinode", "ddp_job.py")
LINUX = sys.platform.startswith("linux")
STEPS, BATCH = 4, 4


def expected_params(world_size: int) -> torch.Tensor:
    """What ddp_job.py's training gives: rank 0's initial weights, gradients averaged over the ranks'
    shards (rank r takes samples r, r + world_size, ...), computed here in one process."""
    torch.manual_seed(1234)  # rank 0's seed; DDP starts every replica from rank 0's weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    shards = [(x[r::world_size], y[r::world_size]) for r in range(world_size)]
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        losses = [torch.nn.functional.mse_loss(model(sx[batch]), sy[batch]) for sx, sy in shards]
        optimizer.zero_grad()
        (sum(losses) / world_size).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_job(out: Path, world_size: int, nodes: int) -> dict[int, dict]:
    ranks = read_ranks(out)
    assert sorted(ranks) == list(range(world_size)), f"rank files: {sorted(ranks)}"
    per_node = world_size // nodes
    for rank, record in ranks.items():
        assert record["world_size"] == world_size
        assert record["node_rank"] == rank // per_node and record["local_rank"] == rank % per_node
        assert record["sum"] == world_size * (world_size + 1) / 2  # all_reduce over every node
        assert record["gathered"] == list(range(world_size))
        assert record["broadcast"] == ranks[0]["broadcast"]
        assert record["samples_seen"] == STEPS * BATCH
    assert len({r["params_sha"] for r in ranks.values()}) == 1, "replicas differ after training"
    torch.testing.assert_close(torch.tensor(ranks[0]["params"]), expected_params(world_size), rtol=1e-5, atol=1e-6)
    return ranks


def run_nodes(commands: list[list[str]], envs: list[dict[str, str]], timeout: float = 90) -> list[tuple[int, str, str]]:
    procs = [start(cmd, env=env) for cmd, env in zip(commands, envs)]
    return finish(procs, timeout)


def assert_all_ok(results: list[tuple[int, str, str]]) -> None:
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node} exited with {code}:\n{out}\n{err[-6000:]}"


# ---- loopback ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_fabric_run_two_nodes_two_processes_each(tmp_path: Path) -> None:
    port = free_port()
    commands = [
        fabric_run("--accelerator", "cpu", "--strategy", "ddp", "--devices", 2, "--num-nodes", 2, "--node-rank", node,
                   "--main-address", "127.0.0.1", "--main-port", port, JOB, tmp_path)
        for node in (1, 0)  # the second node may start first: it waits for the main one
    ]
    assert_all_ok(run_nodes(commands, [clean_env(), clean_env()]))
    ranks = check_job(tmp_path, world_size=4, nodes=2)
    assert {r["env"]["MASTER_PORT"] for r in ranks.values()} == {str(port)}
    assert [ranks[r]["env"]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]


@pytest.mark.timeout(120)
def test_torchrun_two_nodes(tmp_path: Path) -> None:
    port = free_port()
    commands = [
        [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
         "--master_addr", "127.0.0.1", "--master_port", str(port), str(JOB), str(tmp_path)]
        for node in (0, 1)
    ]
    assert_all_ok(run_nodes(commands, [clean_env(), clean_env()]))
    ranks = check_job(tmp_path, world_size=2, nodes=2)
    assert {r["environment"] for r in ranks.values()} == {"TorchElasticEnvironment"}


def _slurm_port_and_job_id() -> tuple[int, int]:
    """A free port in SLURMEnvironment's job-id range (10000 + id % 10000) and a job id that maps to it."""
    for _ in range(200):
        port = random.randrange(10000, 20000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, 40000 + (port - 10000)
    pytest.skip("no free port in 10000-19999 for the simulated SLURM job")


@pytest.mark.timeout(120)
def test_simulated_slurm_two_nodes(tmp_path: Path) -> None:
    """What `srun --nodes 2 --ntasks-per-node 1 python ddp_job.py` exports on each node."""
    port, job_id = _slurm_port_and_job_id()
    common = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "ddp_job", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
              "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NODELIST": "127.0.0.1",
              # what the user writes in Fabric(devices=1, num_nodes=2); here through the connector's variables
              "FABRIC_DEVICES": "1", "FABRIC_NUM_NODES": "2"}
    envs = [clean_env(**common, SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node)) for node in (0, 1)]
    assert_all_ok(run_nodes([[PYTHON, str(JOB), str(tmp_path)]] * 2, envs))
    ranks = check_job(tmp_path, world_size=2, nodes=2)
    assert {r["environment"] for r in ranks.values()} == {"SLURMEnvironment"}
    assert {r["env"]["MASTER_PORT"] for r in ranks.values()} == {str(port)}  # derived from the job id


@pytest.mark.timeout(120)
def test_a_failure_on_one_node_ends_both_nodes(tmp_path: Path) -> None:
    port = free_port()
    commands = [
        fabric_run("--accelerator", "cpu", "--num-nodes", 2, "--node-rank", node, "--main-port", port,
                   JOB, tmp_path, "--fail-rank", 1)
        for node in (0, 1)
    ]
    started = time.monotonic()
    results = run_nodes(commands, [clean_env(), clean_env()], timeout=60)
    assert time.monotonic() - started < 50
    assert results[1][0] != 0 and "rank 1 fails on purpose" in results[1][2]
    assert results[0][0] != 0, "node 0 should fail too: its peer is gone"
    wait_dead([int(p.read_text()) for p in tmp_path.glob("pid*")], timeout=5)


# ---- horovodrun --------------------------------------------------------------------------------------


def _horovod_ready() -> str | None:
    """Why Horovod cannot run here, or None."""
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed (make horovod)"
    if importlib.util.find_spec("fabric.strategies.horovod") is None:
        return "fabric/strategies/horovod.py does not exist yet"
    if shutil.which("horovodrun", path=str(Path(sys.executable).parent)) is None:
        return "horovodrun is not next to this Python"
    return None


@pytest.mark.timeout(120)
@pytest.mark.skipif(_horovod_ready() is not None, reason=str(_horovod_ready()))
def test_the_same_script_under_horovodrun(tmp_path: Path) -> None:
    horovodrun = shutil.which("horovodrun", path=str(Path(sys.executable).parent))
    command = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", PYTHON, str(JOB), str(tmp_path),
               "--strategy", "horovod"]
    proc = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 0, out[-6000:]
    ranks = check_job(tmp_path, world_size=2, nodes=1)
    assert {r["strategy"] for r in ranks.values()} == {"HorovodStrategy"}


# ---- two hosts: network namespaces ---------------------------------------------------------------------


def _ip(*args: str, namespace: str | None = None) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    return subprocess.run([*prefix, "ip", *args] if namespace else ["ip", *args], capture_output=True, text=True,
                          timeout=20)


def _netns_unavailable() -> str | None:
    if not LINUX:
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair: [(namespace, interface, address)] for each host.

    The pair is created inside the first namespace with its peer in the second, and the addresses
    are given inside them, so no traffic touches this machine's own network.
    """
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"fabric-test-{tag}-a", "fabvth0", "10.231.7.1"), (f"fabric-test-{tag}-b", "fabvth1", "10.231.7.2")]
    created: list[str] = []
    try:
        for namespace, _, _ in hosts:
            result = _ip("netns", "add", namespace)
            if result.returncode != 0:
                pytest.skip(f"`ip netns add` is not permitted here: {result.stderr.strip()}")
            created.append(namespace)
        (ns_a, if_a, addr_a), (ns_b, if_b, addr_b) = hosts
        steps = [
            (ns_a, ("link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)),
            (ns_a, ("addr", "add", f"{addr_a}/24", "dev", if_a)),
            (ns_b, ("addr", "add", f"{addr_b}/24", "dev", if_b)),
            (ns_a, ("link", "set", if_a, "up")),
            (ns_b, ("link", "set", if_b, "up")),
            (ns_a, ("link", "set", "lo", "up")),
            (ns_b, ("link", "set", "lo", "up")),
        ]
        for namespace, args in steps:
            result = _ip(*args, namespace=namespace)
            if result.returncode != 0:
                pytest.skip(f"setting up the namespaces failed (`ip {' '.join(args)}`): {result.stderr.strip()}")
        yield hosts
    finally:
        for namespace in created:
            _ip("netns", "del", namespace)


def _rx_bytes(namespace: str, interface: str) -> int:
    result = subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{interface}/statistics/rx_bytes"],
                            capture_output=True, text=True, timeout=20)
    return int(result.stdout.strip() or 0)


@pytest.mark.timeout(120)
def test_fabric_run_on_two_hosts_with_their_own_addresses(tmp_path: Path, two_hosts: list[tuple[str, str, str]]) -> None:
    main_address = two_hosts[0][2]
    port = 29500  # fixed on purpose: the two namespaces are new and private, so nothing else holds it
    before = _rx_bytes(two_hosts[1][0], two_hosts[1][1])
    commands, envs = [], []
    for node, (namespace, interface, _) in enumerate(two_hosts):
        commands.append(["ip", "netns", "exec", namespace, *fabric_run(
            "--accelerator", "cpu", "--num-nodes", 2, "--node-rank", node, "--main-address", main_address,
            "--main-port", port, JOB, tmp_path)])
        envs.append(clean_env(GLOO_SOCKET_IFNAME=interface))  # gloo talks over this host's veth
    assert_all_ok(run_nodes(commands, envs))
    ranks = check_job(tmp_path, world_size=2, nodes=2)
    assert [ranks[r]["local_address"] for r in (0, 1)] == [two_hosts[0][2], two_hosts[1][2]]
    assert {r["env"]["MASTER_ADDR"] for r in ranks.values()} == {main_address}
    assert _rx_bytes(two_hosts[1][0], two_hosts[1][1]) - before > 1000  # the job's traffic crossed the veth pair
