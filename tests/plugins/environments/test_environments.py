"""Tests for fabric.plugins.environments: detection, rank arithmetic and env-var validation."""

from __future__ import annotations

import importlib.machinery
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.plugins import environments as envs
from fabric.plugins.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_cluster_environment,
    find_free_port,
    parse_slurm_nodelist,
)
from support import REPO
from support.loading import script_path

pytestmark = pytest.mark.cold

REPO_ROOT = REPO

# Every variable any environment looks at; cleared before each test so the developer's shell can't leak in.
RELEVANT_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK",
    "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NODELIST",
    "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES",
    "LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
    "KUBERNETES_PORT",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in RELEVANT_VARS:
        monkeypatch.delenv(name, raising=False)


def set_env(monkeypatch, **values):
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


@pytest.fixture
def no_mpi4py(monkeypatch):
    """Make mpi4py unimportable even if it happens to be installed."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)


TORCHELASTIC = dict(
    MASTER_ADDR="10.0.0.1", MASTER_PORT="29501", WORLD_SIZE="8", RANK="5", LOCAL_RANK="1", GROUP_RANK="2",
    LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="abc",
)  # fmt: skip
SLURM = dict(
    SLURM_NTASKS="8", SLURM_JOB_NAME="train", SLURM_PROCID="6", SLURM_LOCALID="2", SLURM_NODEID="1",
    SLURM_NODELIST="gpu[007-008]", SLURM_JOB_ID="123456", SLURM_NTASKS_PER_NODE="4",
)  # fmt: skip
LSF = dict(
    LSB_JOBID="4321", LSB_DJOB_RANKFILE=str(script_path("environments", "lsf_rankfile.txt")),
    JSM_NAMESPACE_LOCAL_RANK="1", JSM_NAMESPACE_SIZE="4",
    JSM_NAMESPACE_RANK="3",
)  # fmt: skip
MPI = dict(OMPI_COMM_WORLD_SIZE="4")
KUBEFLOW = dict(KUBERNETES_PORT="tcp://10.0.0.1:443", MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="3", RANK="2")


# ----------------------------------------------------------------------------------------
# A fake mpi4py that simulates several ranks as threads of this process
# ----------------------------------------------------------------------------------------


class _Hub:
    """State shared by the simulated ranks of one communicator."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list = [None] * size
        self.lock = threading.Lock()
        self.children: dict = {}


class FakeComm:
    def __init__(self, hub: _Hub, rank: int, mpi: FakeMPI) -> None:
        self.hub, self.rank, self.mpi = hub, rank, mpi
        self.splits = 0
        self.freed = False

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.hub.size

    def allgather(self, obj):
        self.hub.slots[self.rank] = obj
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()
        return out

    def bcast(self, obj, root=0):
        return self.allgather(obj)[root]

    def Split_type(self, split_type, key=0):
        assert split_type == self.mpi.COMM_TYPE_SHARED
        self.splits += 1
        entries = self.allgather((self.mpi.Get_processor_name(), key, self.rank))
        my_host = entries[self.rank][0]
        members = sorted((k, r) for h, k, r in entries if h == my_host)
        with self.hub.lock:
            hub = self.hub.children.setdefault((self.splits, my_host), _Hub(len(members)))
        return FakeComm(hub, [r for _, r in members].index(self.rank), self.mpi)

    def Free(self) -> None:
        self.freed = True


class FakeMPI:
    """Stands in for ``mpi4py.MPI``; COMM_WORLD and the host name differ per thread."""

    COMM_TYPE_SHARED = 7

    def __init__(self) -> None:
        self.local = threading.local()

    @property
    def COMM_WORLD(self) -> FakeComm:
        return self.local.world

    def Get_processor_name(self) -> str:
        return self.local.host


class FakeMPINoShared(FakeMPI):
    """An MPI-2 library: no shared-memory split, forcing the host-name fallback."""

    COMM_TYPE_SHARED = None

    def __getattribute__(self, name):
        if name == "COMM_TYPE_SHARED":
            raise AttributeError(name)
        return super().__getattribute__(name)


def install_fake_mpi4py(monkeypatch, mpi: FakeMPI | None = None, world_size: int = 2) -> FakeMPI:
    """Install the fake; the calling thread sees itself as rank 0 of ``world_size`` processes."""
    mpi = mpi or FakeMPI()
    mpi.local.world = FakeComm(_Hub(world_size), 0, mpi)
    mpi.local.host = "host0"
    module = types.ModuleType("mpi4py")
    module.__spec__ = importlib.machinery.ModuleSpec("mpi4py", None)
    module.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", module)
    return mpi


def run_fake_mpi_job(monkeypatch, mpi: FakeMPI, hosts: list[str]) -> list[dict]:
    """Run one MPIEnvironment per simulated rank; rank i lives on hosts[i]."""
    install_fake_mpi4py(monkeypatch, mpi)
    monkeypatch.setattr(socket, "gethostname", lambda: mpi.Get_processor_name())
    world = _Hub(len(hosts))
    results: list = [None] * len(hosts)
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            mpi.local.world = FakeComm(world, rank, mpi)
            mpi.local.host = hosts[rank]
            env = MPIEnvironment()
            results[rank] = dict(
                world_size=env.world_size(), global_rank=env.global_rank(), local_rank=env.local_rank(),
                node_rank=env.node_rank(), main_address=env.main_address, main_port=env.main_port,
            )  # fmt: skip
        except BaseException as err:  # reported to the main thread
            errors.append(err)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    return results


# ----------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "fake_mpi", "expected"),
    [
        ({}, False, LightningEnvironment),
        (dict(LOCAL_RANK="1"), False, LightningEnvironment),
        (TORCHELASTIC, False, TorchElasticEnvironment),
        ({**SLURM, **TORCHELASTIC}, False, TorchElasticEnvironment),
        (SLURM, False, SLURMEnvironment),
        ({**SLURM, "SLURM_JOB_NAME": "bash"}, False, LightningEnvironment),
        ({**SLURM, "SLURM_JOB_NAME": "interactive"}, False, LightningEnvironment),
        ({**SLURM, **LSF}, False, SLURMEnvironment),
        (LSF, False, LSFEnvironment),
        ({**LSF, **MPI}, True, LSFEnvironment),
        (MPI, True, MPIEnvironment),
        (MPI, False, LightningEnvironment),  # MPI launcher but no mpi4py
        (dict(PMI_SIZE="2"), True, MPIEnvironment),
        (dict(PMIX_RANK="0"), True, MPIEnvironment),
        (dict(MPI_LOCALNRANKS="2"), True, MPIEnvironment),
        ({**MPI, **KUBEFLOW}, True, MPIEnvironment),
        (KUBEFLOW, False, KubeflowEnvironment),
        ({**KUBEFLOW, "TORCHELASTIC_RUN_ID": "x"}, False, TorchElasticEnvironment),  # torchrun in a pod
        (dict(TORCHELASTIC_RUN_ID="x", WORLD_SIZE="1", RANK="0"), False, TorchElasticEnvironment),  # as Lightning
        ({**KUBEFLOW, "SLURM_JOB_ID": "1"}, False, LightningEnvironment),
        ({**KUBEFLOW, "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, False, TorchElasticEnvironment),
    ],
)
def test_detection_priority(monkeypatch, env, fake_mpi, expected):
    if fake_mpi:
        install_fake_mpi4py(monkeypatch)
    else:
        monkeypatch.setitem(sys.modules, "mpi4py", None)
    set_env(monkeypatch, **env)
    detected = detect_cluster_environment()
    assert type(detected) is expected


@pytest.mark.parametrize("missing", ["RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
def test_torchelastic_detect_needs_the_run_id_or_all_markers(monkeypatch, missing):
    set_env(monkeypatch, **TORCHELASTIC)
    assert TorchElasticEnvironment.detect()
    monkeypatch.delenv(missing)
    assert TorchElasticEnvironment.detect()  # torchrun's run id alone is enough, as for Lightning
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not TorchElasticEnvironment.detect()


@pytest.mark.parametrize("missing", ["LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE"])
def test_lsf_detect_needs_all_markers(monkeypatch, missing):
    set_env(monkeypatch, **LSF)
    assert LSFEnvironment.detect()
    monkeypatch.delenv(missing)
    assert not LSFEnvironment.detect()


@pytest.mark.parametrize("missing", ["KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"])
def test_kubeflow_detect_needs_all_markers(monkeypatch, missing):
    set_env(monkeypatch, **KUBEFLOW)
    assert KubeflowEnvironment.detect()
    monkeypatch.delenv(missing)
    assert not KubeflowEnvironment.detect()


def test_slurm_detect(monkeypatch):
    assert not SLURMEnvironment.detect()
    set_env(monkeypatch, SLURM_NTASKS="2")
    assert SLURMEnvironment.detect()


def test_lightning_detect_is_always_true():
    assert LightningEnvironment.detect()


def test_cluster_environment_is_abstract_with_noop_defaults():
    with pytest.raises(TypeError):
        ClusterEnvironment()  # type: ignore[abstract]

    class Minimal(ClusterEnvironment):
        creates_processes_externally = False
        main_address = "h"
        main_port = 1

        @staticmethod
        def detect():
            return False

        def world_size(self):
            return 1

        def set_world_size(self, size):
            pass

        def global_rank(self):
            return 0

        def set_global_rank(self, rank):
            pass

        def local_rank(self):
            return 0

        def node_rank(self):
            return 0

    env = Minimal()
    assert env.validate_settings(num_devices=8, num_nodes=8) is None
    assert env.teardown() is None


def test_all_exports_exist():
    for name in envs.__all__:
        assert hasattr(envs, name), name
    assert {"ClusterEnvironment", "LocalEnvironment", "detect_cluster_environment"} <= set(envs.__all__)


# ----------------------------------------------------------------------------------------
# LightningEnvironment
# ----------------------------------------------------------------------------------------


def test_local_environment_alias():
    assert LocalEnvironment is LightningEnvironment


def test_lightning_defaults():
    env = LightningEnvironment()
    assert env.creates_processes_externally is False
    assert env.main_address == "127.0.0.1"
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (1, 0, 0, 0)


def test_lightning_reads_env(monkeypatch):
    set_env(monkeypatch, LOCAL_RANK="3", NODE_RANK="2", GROUP_RANK="9", MASTER_ADDR="10.1.2.3", MASTER_PORT="4242")
    env = LightningEnvironment()
    assert env.creates_processes_externally is True
    assert env.local_rank() == 3
    assert env.node_rank() == 2  # NODE_RANK wins over GROUP_RANK
    assert env.main_address == "10.1.2.3"
    assert env.main_port == 4242
    monkeypatch.delenv("NODE_RANK")
    assert env.node_rank() == 9


def test_lightning_setters():
    env = LightningEnvironment()
    env.set_world_size(8)
    env.set_global_rank(5)
    assert (env.world_size(), env.global_rank()) == (8, 5)
    # The setters keep state on the instance only; nothing leaks into the environment.
    assert "WORLD_SIZE" not in os.environ and "RANK" not in os.environ


@pytest.mark.parametrize(("method", "value"), [("set_world_size", 0), ("set_world_size", "2"), ("set_global_rank", -1)])
def test_lightning_setters_reject_bad_values(method, value):
    with pytest.raises(ValueError, match=repr(value).replace("'", ".")):
        getattr(LightningEnvironment(), method)(value)


def test_lightning_free_port_is_free_stable_and_not_exported():
    env = LightningEnvironment()
    port = env.main_port
    assert 1 <= port <= 65535
    # environments never write the rendezvous point: the launcher exports it before starting ranks
    assert "MASTER_PORT" not in os.environ
    # Nothing holds it: we can bind it ourselves.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    assert env.main_port == port


def test_lightning_teardown_clears_world_size_and_keeps_the_port(monkeypatch):
    set_env(monkeypatch, MASTER_PORT="5555", WORLD_SIZE="4")
    env = LightningEnvironment()
    assert env.main_port == 5555
    env.teardown()
    assert "WORLD_SIZE" not in os.environ  # as Lightning's teardown does
    assert os.environ["MASTER_PORT"] == "5555"
    env.teardown()  # a second teardown is harmless


def test_find_free_port_returns_bindable_port():
    port = find_free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


# ----------------------------------------------------------------------------------------
# TorchElasticEnvironment
# ----------------------------------------------------------------------------------------


def test_torchelastic_values(monkeypatch, caplog):
    set_env(monkeypatch, **TORCHELASTIC)
    env = TorchElasticEnvironment()
    assert env.creates_processes_externally is True
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29501)
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 5, 1, 2)
    with caplog.at_level(logging.DEBUG, logger=envs.__name__):
        env.set_world_size(3)
        env.set_global_rank(0)
    assert (env.world_size(), env.global_rank()) == (8, 5)
    assert "ignores set_world_size" in caplog.text and "ignores set_global_rank" in caplog.text


def test_torchelastic_validate_settings(monkeypatch):
    set_env(monkeypatch, **TORCHELASTIC)
    env = TorchElasticEnvironment()
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=8.*devices=2.*num_nodes=1"):
        env.validate_settings(num_devices=2, num_nodes=1)


def test_torchelastic_missing_master_addr(monkeypatch):
    set_env(monkeypatch, **TORCHELASTIC)
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        TorchElasticEnvironment().main_address  # noqa: B018 - reading the property is what raises


# ----------------------------------------------------------------------------------------
# SLURMEnvironment and the nodelist parser
# ----------------------------------------------------------------------------------------


def test_slurm_values(monkeypatch, caplog):
    set_env(monkeypatch, **SLURM)
    env = SLURMEnvironment()
    assert env.creates_processes_externally is True
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (8, 6, 2, 1)
    assert env.main_address == "gpu007"
    assert env.main_port == 10000 + 123456 % 10000 == 13456
    with caplog.at_level(logging.DEBUG, logger=envs.__name__):
        env.set_world_size(1)
        env.set_global_rank(0)
    assert (env.world_size(), env.global_rank()) == (8, 6)


def test_slurm_address_and_port_overrides(monkeypatch):
    set_env(monkeypatch, **SLURM, MASTER_ADDR="login1", MASTER_PORT="31337")
    env = SLURMEnvironment()
    assert (env.main_address, env.main_port) == ("login1", 31337)


def test_slurm_job_nodelist_fallback_and_missing(monkeypatch):
    set_env(monkeypatch, **SLURM)
    monkeypatch.delenv("SLURM_NODELIST")
    set_env(monkeypatch, SLURM_JOB_NODELIST="cn[10-11]")
    assert SLURMEnvironment().main_address == "cn10"
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    assert SLURMEnvironment().main_address == "127.0.0.1"  # Lightning's default
    assert "MASTER_ADDR" not in os.environ  # read, never written


def test_slurm_requeue_settings_and_inconsistent_srun(monkeypatch):
    env = SLURMEnvironment()
    assert env.auto_requeue is True and env.requeue_signal == signal.SIGUSR1
    env = SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGUSR2)
    assert env.auto_requeue is False and env.requeue_signal == signal.SIGUSR2
    set_env(monkeypatch, **SLURM)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")  # `srun --ntasks=8` alone
    with pytest.raises(RuntimeError, match=r"--ntasks=8.*--ntasks-per-node"):
        SLURMEnvironment()
    set_env(monkeypatch, SLURM_NTASKS="1")
    SLURMEnvironment()  # one task needs no per-node count


@pytest.mark.parametrize("job_id", [0, 1, 9999, 10000, 123456, 987654321])
def test_slurm_port_range(monkeypatch, job_id):
    set_env(monkeypatch, SLURM_JOB_ID=job_id)
    port = SLURMEnvironment().main_port
    assert 10000 <= port <= 19999
    assert port == 10000 + job_id % 10000


def test_slurm_validate_settings(monkeypatch):
    set_env(monkeypatch, **SLURM)
    env = SLURMEnvironment()
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    env.validate_settings(num_devices=3, num_nodes=5)  # nothing to compare against
    set_env(monkeypatch, SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="2")
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=r"SLURM_NTASKS_PER_NODE=4.*devices=2"):
        env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"SLURM_NNODES=2.*num_nodes=3"):
        env.validate_settings(num_devices=4, num_nodes=3)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node001", ["node001"]),
        ("node[001-003,007],gpu5", ["node001", "node002", "node003", "node007", "gpu5"]),
        ("gpu5,node[1-2]", ["gpu5", "node1", "node2"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("n[5]", ["n5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("[1-2]x", ["1x", "2x"]),
        ("host-1.example.com", ["host-1.example.com"]),
        ("a[1, 3] b", ["a1", "a3", "b"]),
        ("a,,b,", ["a", "b"]),
    ],
)
def test_parse_slurm_nodelist(nodelist, hosts):
    assert list(parse_slurm_nodelist(nodelist)) == hosts
    assert SLURMEnvironment.resolve_root_node_address(nodelist) == hosts[0]


@pytest.mark.parametrize(
    "nodelist",
    ["", " , ", "node[1-3", "node1-3]", "node]1[", "node[3-1]", "node[a-b]", "node[]", "node[[1]]", "node[1-2,]",
     "node[1-]", "ok,bad[", "a]b[1]"],
)  # fmt: skip
def test_parse_slurm_nodelist_rejects_malformed(nodelist):
    with pytest.raises(ValueError, match="nodelist"):
        parse_slurm_nodelist(nodelist)  # eager: fails before any host is taken


_literal = st.text(alphabet="abcxyz-._", min_size=1, max_size=4)


@st.composite
def _bracket(draw):
    """One bracket group as (text, hosts-fragments)."""
    parts, expanded = [], []
    for _ in range(draw(st.integers(1, 3))):
        low = draw(st.integers(0, 120))
        span = draw(st.integers(0, 4))
        width = draw(st.integers(len(str(low)), len(str(low)) + 2))
        low_text = format(low, f"0{width}d")
        if span == 0 and draw(st.booleans()):
            parts.append(low_text)
        else:
            parts.append(f"{low_text}-{low + span}")
        expanded += [format(n, f"0{width}d") for n in range(low, low + span + 1)]
    return "[" + ",".join(parts) + "]", expanded


@st.composite
def _item(draw):
    text = draw(_literal)
    hosts = [text]
    for _ in range(draw(st.integers(0, 2))):
        bracket_text, fragments = draw(_bracket())
        suffix = draw(st.one_of(st.just(""), _literal))
        text += bracket_text + suffix
        hosts = [h + f + suffix for h in hosts for f in fragments]
    return text, hosts


@settings(max_examples=200, deadline=None)
@given(st.lists(_item(), min_size=1, max_size=3))
def test_parse_slurm_nodelist_property(items):
    nodelist = ",".join(text for text, _ in items)
    expected = [host for _, hosts in items for host in hosts]
    assert SLURMEnvironment.resolve_root_node_address(nodelist) == expected[0]
    assert list(parse_slurm_nodelist(nodelist)) == expected


# ----------------------------------------------------------------------------------------
# LSFEnvironment
# ----------------------------------------------------------------------------------------


@pytest.fixture
def lsf(monkeypatch, tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch01\nnodeA\nnodeA\n\nnodeB\nnodeB\n")
    set_env(monkeypatch, **{**LSF, "LSB_DJOB_RANKFILE": rankfile})
    return rankfile


def test_lsf_values(monkeypatch, lsf):
    monkeypatch.setattr(socket, "gethostname", lambda: "nodeB")
    env = LSFEnvironment()
    assert env.creates_processes_externally is True
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert env.main_address == "nodeA"  # the launch node batch01 is skipped
    assert env.main_port == 10000 + 4321 % 1000  # Lightning's default port
    set_env(monkeypatch, MASTER_PORT="20001")
    assert LSFEnvironment().main_port == 20001
    env.set_world_size(1)
    assert env.world_size() == 4


def test_lsf_node_rank_matches_short_and_qualified_names(monkeypatch, lsf):
    monkeypatch.setattr(socket, "gethostname", lambda: "nodeA.cluster.local")
    assert LSFEnvironment().node_rank() == 0
    lsf.write_text("batch01\nnodeA.cluster.local\nnodeB.cluster.local\n")
    monkeypatch.setattr(socket, "gethostname", lambda: "nodeB")
    assert LSFEnvironment().node_rank() == 1


def test_lsf_errors(monkeypatch, lsf):
    monkeypatch.setattr(socket, "gethostname", lambda: "elsewhere")
    with pytest.raises(ValueError, match="'elsewhere'"):
        LSFEnvironment().node_rank()
    lsf.write_text("batch01\n")
    with pytest.raises(ValueError, match="no compute hosts"):
        LSFEnvironment()
    set_env(monkeypatch, LSB_DJOB_RANKFILE=lsf.parent / "missing")
    with pytest.raises(ValueError, match=r"LSB_DJOB_RANKFILE=.*missing"):
        LSFEnvironment()
    # as Lightning: a missing or empty rank file variable, or no job id, fail when the environment is made
    set_env(monkeypatch, LSB_DJOB_RANKFILE="")
    with pytest.raises(ValueError, match="LSB_DJOB_RANKFILE is empty"):
        LSFEnvironment()
    monkeypatch.delenv("LSB_DJOB_RANKFILE")
    with pytest.raises(ValueError, match="LSB_DJOB_RANKFILE is not set"):
        LSFEnvironment()
    set_env(monkeypatch, LSB_DJOB_RANKFILE=lsf)
    lsf.write_text("batch01\nnodeA\n")
    monkeypatch.delenv("LSB_JOBID")
    with pytest.raises(ValueError, match="LSB_JOBID"):
        LSFEnvironment()


def test_lsf_validate_settings(monkeypatch, lsf):
    env = LSFEnvironment()
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"JSM_NAMESPACE_SIZE=4.*devices=4.*num_nodes=2"):
        env.validate_settings(num_devices=4, num_nodes=2)


# ----------------------------------------------------------------------------------------
# KubeflowEnvironment
# ----------------------------------------------------------------------------------------


def test_kubeflow_values(monkeypatch):
    set_env(monkeypatch, **KUBEFLOW)
    env = KubeflowEnvironment()
    assert env.creates_processes_externally is True
    assert (env.main_address, env.main_port) == ("job-master-0", 23456)
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (3, 2, 0, 2)
    env.set_global_rank(0)
    assert env.global_rank() == 2
    env.validate_settings(num_devices=1, num_nodes=3)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3.*devices=1.*num_nodes=1"):
        env.validate_settings(num_devices=1, num_nodes=1)


# ----------------------------------------------------------------------------------------
# MPIEnvironment
# ----------------------------------------------------------------------------------------


def test_mpi_not_detected_without_mpi4py(monkeypatch, no_mpi4py):
    set_env(monkeypatch, **MPI)
    assert not MPIEnvironment.detect()


def test_mpi_detected_with_a_launcher_and_more_than_one_process(monkeypatch):
    install_fake_mpi4py(monkeypatch)
    assert not MPIEnvironment.detect()
    set_env(monkeypatch, **MPI)
    assert MPIEnvironment.detect()
    install_fake_mpi4py(monkeypatch, world_size=1)  # as Lightning: one MPI process is no MPI job
    assert not MPIEnvironment.detect()


def test_mpi_construct_without_mpi4py_hints_install(no_mpi4py):
    with pytest.raises(ImportError, match="pip install mpi4py"):
        MPIEnvironment()


def test_mpi_use_without_mpi4py_hints_install(monkeypatch):
    install_fake_mpi4py(monkeypatch)
    env = MPIEnvironment()  # constructing does not import mpi4py yet
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match="pip install mpi4py"):
        env.world_size()


@pytest.mark.parametrize("mpi_cls", [FakeMPI, FakeMPINoShared])
@pytest.mark.parametrize(
    ("hosts", "local_ranks", "node_ranks"),
    [
        # interleaved placement, uneven nodes; the node of rank 0 is node 0
        (["hostB", "hostA", "hostB", "hostA", "hostB"], [0, 0, 1, 1, 2], [0, 1, 0, 1, 0]),
        # blocks; node ranks are dense (0, 1, 2) even though leaders are ranks 0, 2, 3
        (["n9", "n9", "n1", "n5", "n5"], [0, 1, 0, 0, 1], [0, 0, 1, 2, 2]),
    ],
)
def test_mpi_ranks_across_simulated_nodes(monkeypatch, mpi_cls, hosts, local_ranks, node_ranks):
    results = run_fake_mpi_job(monkeypatch, mpi_cls(), hosts)
    assert [r["world_size"] for r in results] == [5] * 5
    assert [r["global_rank"] for r in results] == [0, 1, 2, 3, 4]
    assert [r["local_rank"] for r in results] == local_ranks
    assert [r["node_rank"] for r in results] == node_ranks
    assert {r["main_address"] for r in results} == {hosts[0]}  # rank 0's host, broadcast
    ports = {r["main_port"] for r in results}
    assert len(ports) == 1 and 1 <= ports.pop() <= 65535
    assert "MASTER_PORT" not in os.environ


def test_mpi_uses_master_addr_and_port_from_rank_zero(monkeypatch):
    set_env(monkeypatch, MASTER_ADDR="head", MASTER_PORT="24680")
    results = run_fake_mpi_job(monkeypatch, FakeMPI(), ["h0", "h1"])
    assert {(r["main_address"], r["main_port"]) for r in results} == {("head", 24680)}


def test_mpi_validate_settings(monkeypatch):
    mpi = install_fake_mpi4py(monkeypatch)
    mpi.local.world = FakeComm(_Hub(1), 0, mpi)
    mpi.local.host = "solo"
    monkeypatch.setattr(socket, "gethostname", lambda: "solo")
    env = MPIEnvironment()
    env.validate_settings(num_devices=1, num_nodes=1)
    with pytest.raises(ValueError, match=r"MPI world size=1.*devices=2"):
        env.validate_settings(num_devices=2, num_nodes=1)
    env.set_world_size(4)
    assert env.world_size() == 1


@pytest.mark.procs
def test_import_does_not_import_mpi4py(tmp_path):
    # A findable fake mpi4py: if anything imported it eagerly, it would show up in sys.modules.
    pkg = tmp_path / "mpi4py"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    script = textwrap.dedent(
        """
        import os, sys
        import fabric.plugins.environments as envs
        assert "mpi4py" not in sys.modules, "imported at module import"
        envs.detect_cluster_environment()
        assert "mpi4py" not in sys.modules, "imported by detection in a plain run"
        env = envs.MPIEnvironment()
        assert "mpi4py" not in sys.modules, "imported by the constructor"
        try:
            env.world_size()  # the fake has no MPI submodule
        except ImportError as err:
            assert "pip install mpi4py" in str(err)
        assert "mpi4py" in sys.modules, "control: first use must import it"
        print("OK")
        """
    )
    child_env = {k: v for k, v in os.environ.items() if k not in RELEVANT_VARS}
    child_env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO_ROOT)])
    proc = subprocess.run(
        [sys.executable, "-c", script], env=child_env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


# ----------------------------------------------------------------------------------------
# Malformed values
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_cls", "base", "var", "bad", "call"),
    [
        (TorchElasticEnvironment, TORCHELASTIC, "RANK", "x", lambda e: e.global_rank()),
        (TorchElasticEnvironment, TORCHELASTIC, "WORLD_SIZE", "0", lambda e: e.world_size()),
        (TorchElasticEnvironment, TORCHELASTIC, "LOCAL_RANK", "-1", lambda e: e.local_rank()),
        (TorchElasticEnvironment, TORCHELASTIC, "GROUP_RANK", "1.5", lambda e: e.node_rank()),
        (TorchElasticEnvironment, TORCHELASTIC, "MASTER_PORT", "70000", lambda e: e.main_port),
        (TorchElasticEnvironment, TORCHELASTIC, "MASTER_PORT", "http", lambda e: e.main_port),
        (TorchElasticEnvironment, TORCHELASTIC, "MASTER_ADDR", "  ", lambda e: e.main_address),
        (LightningEnvironment, {}, "LOCAL_RANK", "one", lambda e: e.local_rank()),
        (LightningEnvironment, {}, "NODE_RANK", "", lambda e: e.node_rank()),
        (LightningEnvironment, {}, "GROUP_RANK", "two", lambda e: e.node_rank()),
        (LightningEnvironment, {}, "MASTER_PORT", "0", lambda e: e.main_port),
        (SLURMEnvironment, SLURM, "SLURM_PROCID", "abc", lambda e: e.global_rank()),
        (SLURMEnvironment, SLURM, "SLURM_NTASKS", "many", lambda e: e.world_size()),
        (SLURMEnvironment, SLURM, "SLURM_LOCALID", "x1", lambda e: e.local_rank()),
        (SLURMEnvironment, SLURM, "SLURM_NODEID", "n", lambda e: e.node_rank()),
        (SLURMEnvironment, SLURM, "SLURM_JOB_ID", "12_ab", lambda e: e.main_port),
        (SLURMEnvironment, SLURM, "SLURM_NTASKS_PER_NODE", "2(x3)", lambda e: e.validate_settings(2, 3)),
        (SLURMEnvironment, SLURM, "SLURM_NNODES", "zz", lambda e: e.validate_settings(4, 3)),
        (LSFEnvironment, LSF, "JSM_NAMESPACE_RANK", "r", lambda e: e.global_rank()),
        (LSFEnvironment, LSF, "JSM_NAMESPACE_SIZE", "-4", lambda e: e.world_size()),
        (LSFEnvironment, LSF, "JSM_NAMESPACE_LOCAL_RANK", "?", lambda e: e.local_rank()),
        (LSFEnvironment, LSF, "LSB_JOBID", "job7", lambda e: e.main_port),  # raised when made
        (KubeflowEnvironment, KUBEFLOW, "RANK", "x", lambda e: e.global_rank()),
        (KubeflowEnvironment, KUBEFLOW, "RANK", "x", lambda e: e.node_rank()),
        (KubeflowEnvironment, KUBEFLOW, "WORLD_SIZE", "3.0", lambda e: e.world_size()),
        (KubeflowEnvironment, KUBEFLOW, "MASTER_PORT", "-1", lambda e: e.main_port),
    ],
)
def test_malformed_values_raise_value_error(monkeypatch, env_cls, base, var, bad, call):
    set_env(monkeypatch, **base)
    set_env(monkeypatch, **{var: bad})
    with pytest.raises(ValueError, match=var) as excinfo:
        call(env_cls())
    assert var in str(excinfo.value)
    assert repr(bad) in str(excinfo.value)


@pytest.mark.parametrize(
    ("env_cls", "base", "var", "call"),
    [
        (TorchElasticEnvironment, TORCHELASTIC, "WORLD_SIZE", lambda e: e.world_size()),
        (SLURMEnvironment, SLURM, "SLURM_PROCID", lambda e: e.global_rank()),
        (SLURMEnvironment, SLURM, "SLURM_JOB_ID", lambda e: e.main_port),
        (LSFEnvironment, LSF, "JSM_NAMESPACE_RANK", lambda e: e.global_rank()),
    ],
)
def test_missing_required_values_raise_value_error(monkeypatch, env_cls, base, var, call):
    set_env(monkeypatch, **base)
    monkeypatch.delenv(var)
    with pytest.raises(ValueError, match=f"{var} is required"):
        call(env_cls())


# ----------------------------------------------------------------------------------------
# Wired into Fabric: the job the cluster started must be the job the code describes
# ----------------------------------------------------------------------------------------


def test_a_torchrun_job_of_another_size_fails_when_fabric_is_made(monkeypatch):
    from fabric import Fabric

    set_env(monkeypatch, **TORCHELASTIC)  # 8 processes, 2 per node
    with pytest.raises(ValueError, match=r"WORLD_SIZE=8.*devices=3 x num_nodes=1"):
        Fabric(accelerator="cpu", devices=3, strategy="ddp")
    fabric = Fabric(accelerator="cpu", strategy="ddp")  # devices="auto": what torchrun started
    assert (fabric.world_size, fabric.global_rank, fabric.node_rank) == (8, 5, 2)


def test_a_slurm_job_of_another_shape_fails_when_fabric_is_made(monkeypatch):
    from fabric import Fabric

    set_env(monkeypatch, **SLURM, SLURM_NNODES="2")  # 2 nodes x 4 tasks
    with pytest.raises(ValueError, match=r"SLURM_NTASKS_PER_NODE=4 but devices=2"):
        Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp")
    with pytest.raises(ValueError, match=r"SLURM_NNODES=2 but num_nodes=1"):
        Fabric(accelerator="cpu", devices=4, strategy="ddp")
    fabric = Fabric(accelerator="cpu", devices=4, num_nodes=2, strategy="ddp")
    assert isinstance(fabric.strategy.cluster_environment, SLURMEnvironment)
    assert (fabric.world_size, fabric.global_rank) == (8, 6)


def test_a_custom_environment_inside_a_slurm_job_keeps_its_world_size(monkeypatch):
    from fabric import Fabric

    class OwnLauncher(LightningEnvironment):
        @property
        def creates_processes_externally(self) -> bool:
            return True

    set_env(monkeypatch, **SLURM, SLURM_NNODES="2")  # Slurm says 8 tasks; the plugin's job has 2 ranks
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[OwnLauncher()])
    environment = fabric.strategy.cluster_environment
    assert type(environment) is OwnLauncher  # not replaced by the detected Slurm environment
    fabric.strategy._set_world_ranks()  # what launching does in every rank
    assert environment.world_size() == fabric.world_size == 2
