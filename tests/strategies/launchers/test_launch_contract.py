"""Launching: ranks are right straight after ``Fabric(...)``, and a script that never calls
``fabric.launch()`` runs under external launchers (real processes: torchrun, ``fabric run``, and
srun and Kubeflow simulated by their environment variables). The launchers start fresh; the ranks they start run
warm (their subject is what our code in a rank does without ``launch()``, not a Python process starting).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fabric import Fabric
from fabric.strategies import DDPStrategy
from support.environment import free_port, isolate, job_environment
from support.loading import script_path

SCRIPT = script_path("launchers", "no_launch.py")
TIMEOUT = 120


@pytest.fixture
def clean_env(monkeypatch):
    isolate(monkeypatch)


# ---- ranks before launch() ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork", DDPStrategy(start_method="spawn")])
def test_world_size_is_right_straight_after_construction(clean_env, strategy):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    assert (fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank) == (2, 0, 0, 0)
    assert fabric.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_ranks_of_a_second_node_before_launch(clean_env, monkeypatch):
    monkeypatch.setenv("NODE_RANK", "1")
    fabric = Fabric(accelerator="cpu", devices=3, num_nodes=2, strategy="ddp_spawn")
    assert (fabric.world_size, fabric.global_rank, fabric.node_rank) == (6, 3, 1)


def test_without_an_external_launcher_setup_still_needs_launch(clean_env):
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    with pytest.raises(RuntimeError, match=r"before Fabric.launch\(\)"):
        fabric.setup_dataloaders([1, 2])


# ---- real jobs that never call launch() -------------------------------------------------------------


def _reports(outdir: Path, count: int) -> list[dict]:
    files = sorted(outdir.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(count)], [f.name for f in files]
    return [json.loads(f.read_text()) for f in files]


def _check(reports: list[dict], devices: int, num_nodes: int, environment: str) -> None:
    world = devices * num_nodes
    for rank, report in enumerate(reports):
        node, local = divmod(rank, devices)
        assert report["before_launch"] == [world, rank, local, node], report
        assert report["after"] == [world, rank, local, node], report
        assert report["total"] == world * (world + 1) / 2
        assert report["same_weights"], "set-up without launch() must still broadcast rank 0's weights"
        assert report["environment"] == environment


def _run(command: list[str], env: dict[str, str]) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT - 10)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.procs
@pytest.mark.timeout(TIMEOUT)
def test_no_launch_under_torchrun(tmp_path):
    env = job_environment()
    port = env.pop("MASTER_PORT")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
        str(SCRIPT), str(tmp_path), "2", "1",
    ]
    _run(command, env)
    _check(_reports(tmp_path, 2), devices=2, num_nodes=1, environment="TorchElasticEnvironment")


@pytest.mark.procs
@pytest.mark.timeout(TIMEOUT)
def test_no_launch_under_fabric_run_and_launch_stays_allowed(tmp_path):
    env = job_environment()
    env["CALL_LAUNCH_TOO"] = "1"
    command = [sys.executable, "-m", "fabric", "run", "--accelerator", "cpu", "--devices", "2", str(SCRIPT), str(tmp_path), "2", "1"]
    _run(command, env)
    reports = _reports(tmp_path, 2)
    _check(reports, devices=2, num_nodes=1, environment=reports[0]["environment"])
    assert all(report["launch_again_total"] == 2 for report in reports)


def _mpirun() -> Path:
    """The ``mpirun`` next to this interpreter (the MPICH wheel of the ``mpi`` extra puts it there)."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists() or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs the `mpi` extra (mpi4py and MPICH's mpirun): pip install -e '.[mpi]'")
    return mpirun


@pytest.mark.procs
@pytest.mark.cold  # MPICH hands each rank its PMI connection as an open file, which a warm worker does not inherit
@pytest.mark.timeout(TIMEOUT)
def test_no_launch_under_mpirun_and_launch_stays_allowed(tmp_path):
    env = job_environment()
    env["CALL_LAUNCH_TOO"] = "1"
    command = [str(_mpirun()), "-n", "2", sys.executable, str(SCRIPT), str(tmp_path), "2", "1"]
    _run(command, env)
    reports = _reports(tmp_path, 2)
    _check(reports, devices=2, num_nodes=1, environment="MPIEnvironment")
    assert all(report["launch_again_total"] == 2 for report in reports)


def _start_by_hand(tmp_path: Path, per_rank_env: list[dict[str, str]], devices: int, num_nodes: int) -> None:
    """Start one process per rank with a scheduler's variables, as srun or the Kubeflow operator would."""
    processes = []
    for extra in per_rank_env:
        env = job_environment()
        env.update(extra)
        command = [sys.executable, str(SCRIPT), str(tmp_path), str(devices), str(num_nodes)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=TIMEOUT - 10) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]


@pytest.mark.procs
@pytest.mark.timeout(TIMEOUT)
def test_no_launch_under_slurm_variables(tmp_path):
    port = str(free_port())
    ranks = [
        {
            "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1",
            "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
            "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }
        for r in range(2)
    ]
    _start_by_hand(tmp_path, ranks, devices=2, num_nodes=1)
    _check(_reports(tmp_path, 2), devices=2, num_nodes=1, environment="SLURMEnvironment")


@pytest.mark.procs
@pytest.mark.timeout(TIMEOUT)
def test_no_launch_under_kubeflow_variables(tmp_path):
    port = str(free_port())
    ranks = [
        {"KUBERNETES_PORT": "tcp://10.0.0.1:443", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(r)}
        for r in range(2)
    ]
    # one process per pod, each pod a node
    _start_by_hand(tmp_path, ranks, devices=1, num_nodes=2)
    _check(_reports(tmp_path, 2), devices=1, num_nodes=2, environment="KubeflowEnvironment")
