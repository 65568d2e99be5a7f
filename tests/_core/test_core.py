"""The torch-free core: device syntax, rank variables, and the rank read for rank-zero-only output."""

from __future__ import annotations

import pytest

from fabric._core.cluster import GLOBAL_RANK_VARIABLES, in_slurm_batch_job, rank_from_environment
from fabric._core.devices import DevicesSyntaxError, parse_devices
from fabric._core.env import fabric_variable, global_rank, rank_environment


@pytest.mark.parametrize(
    ("devices", "parsed"),
    [
        ("auto", "all"), (-1, "all"), ("-1", "all"), (" -1 ", "all"),
        (2, 2), ("2", 2), (" 3 ", 3),
        ("0,1", [0, 1]), ("1,", [1]), ("[0, 1]", [0, 1]), ("[3]", [3]), ([2, 0], [2, 0]), ((1,), [1]),
    ],
)  # fmt: skip
def test_device_syntax(devices, parsed):
    assert parse_devices(devices) == parsed


@pytest.mark.parametrize("devices", [0, -2, "0", "-2", "two", "", ",", "a,b", "0,-1", [], [-1], [True], True, None, 1.5, {0}])
def test_device_syntax_errors(devices):
    with pytest.raises(DevicesSyntaxError):
        parse_devices(devices)


@pytest.mark.parametrize("devices", ["0,0", [1, 1], "[2, 2]"])
def test_a_device_named_twice(devices):
    with pytest.raises(ValueError, match="names a device more than once"):
        parse_devices(devices)


def test_rank_variables_follow_one_formula():
    assert fabric_variable("num_nodes") == "FABRIC_NUM_NODES"
    assert global_rank(node_rank=2, processes_per_node=4, local_rank=3) == 11
    env = rank_environment("10.0.0.1", 29500, node_rank=1, num_nodes=2, processes_per_node=3, local_rank=2)
    assert env["RANK"] == env["ROLE_RANK"] == "5" and env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "6"
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["NODE_RANK"]) == ("2", "3", "1", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["GROUP_WORLD_SIZE"]) == ("10.0.0.1", "29500", "2")


@pytest.mark.parametrize(
    ("variables", "rank"),
    [({}, 0), ({"RANK": "3"}, 3), ({"SLURM_PROCID": "7"}, 7), ({"OMPI_COMM_WORLD_RANK": "2"}, 2),
     ({"RANK": "x", "PMI_RANK": "4"}, 4), ({"JSM_NAMESPACE_RANK": "5"}, 5)],
)  # fmt: skip
def test_the_rank_for_rank_zero_output_comes_from_any_launcher(monkeypatch, variables, rank):
    for name in GLOBAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert rank_from_environment() == rank


def test_the_cluster_environments_share_core_rules(monkeypatch):
    """One copy of each rule: the environments' rank-zero rank and Slurm detection are _core's."""
    from fabric.plugins import environments

    assert environments.rank_from_environment is rank_from_environment
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    for job_name, detected in (("train", True), ("bash", False), ("interactive", False)):
        monkeypatch.setenv("SLURM_JOB_NAME", job_name)
        assert in_slurm_batch_job() is detected
        assert environments.SLURMEnvironment.detect() is detected
