"""The parts of fault tolerance under real faults, each on its own, in this process (no process is started).

The quorum's checks (sizes, duplicate groups, a group that would start over alone) and what a lost lighthouse
says; the healing transfer behind the job's secret; the step watch that ends a stalled rank; the job's secret and
address; the strategies' timeouts. The jobs with real groups are in ``test_fault_tolerant_faults.py``.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fabric._core.job_secret import JOB_SECRET_ENV, JobSecretError, job_secret
from fabric._core.listening import lighthouse_on_loopback, replica_job_address
from fabric.strategies.fault_tolerant import (
    DEFAULT_STEP_TIMEOUT,
    FaultTolerantStrategy,
    HSDPFaultTolerantStrategy,
    import_torchft,
)
from fabric.supervision.step_watch import Stall, StepWatch, StepWatchReader, describe_stall

# ---- the quorum's checks ------------------------------------------------------------------------------


class _Client:
    """torchft's ManagerClient as the QuorumClient sees it: ``_quorum`` gives the next quorum, or raises."""

    def __init__(self, *quorums: object) -> None:
        self.quorums = list(quorums)

    def _quorum(self, **kwargs: object) -> object:
        quorum = self.quorums.pop(0)
        if isinstance(quorum, BaseException):
            raise quorum
        return quorum

    def should_commit(self, *args: object) -> str:
        return "forwarded"


def _quorum(*ids: str, max_step: int = 5, quorum_id: int = 3) -> SimpleNamespace:
    return SimpleNamespace(replica_ids=[f"{name}:uuid{index}" for index, name in enumerate(ids)], max_step=max_step,
                           quorum_id=quorum_id, store_address="127.0.0.1:4567")


def _client(*quorums: object, steps_before: int = 0, lighthouse: str = "http://127.0.0.1:1", group: int = 0):
    import_torchft()
    from fabric.strategies.replica_quorum import QuorumClient

    return QuorumClient(_Client(*quorums), strategy="ddp_ft", groups=2, ranks=1, group=group, lighthouse=lighthouse,
                        quorum_timeout=timedelta(seconds=7), steps_before=steps_before)


def test_a_fitting_quorum_passes_with_a_store_prefix_of_its_own_and_other_calls_are_forwarded() -> None:
    from fabric.strategies.replica_quorum import replica_id

    ids = (replica_id("ddp_ft", 2, 1, 0), replica_id("ddp_ft", 2, 1, 1))
    first, again = _quorum(*ids, quorum_id=1, max_step=0), _quorum(*ids, quorum_id=1, max_step=12)
    client = _client(first, again)
    assert client._quorum().store_address.startswith("127.0.0.1:4567/fabric/")
    # the lighthouse was restarted: its quorum number starts again, but the prefix is not the first quorum's
    assert client._quorum().store_address != first.store_address
    assert client.should_commit() == "forwarded"
    assert replica_id("ddp_ft", 2, 1, 1).endswith("group1")  # torchft reads the group's number from the trailing digits


@pytest.mark.parametrize(
    ("ids", "said"),
    [
        (("fabric-ddp_ft-2groups-1ranks-group0", "fabric-ddp_ft-2groups-2ranks-group1"),
         "different numbers of ranks (group 0: 1, group 1: 2)"),
        (("fabric-ddp_ft-2groups-1ranks-group0", "fabric-ddp_ft-2groups-1ranks-group0"),
         "2 replica groups of this job run as --replica-group 0"),
        (("fabric-ddp_ft-2groups-1ranks-group0", "fabric-ddp_ft-3groups-1ranks-group1"),
         "different numbers of replica groups (group 0: 2, group 1: 3)"),
        (("fabric-ddp_ft-2groups-1ranks-group0", "fabric-hsdp_ft-2groups-1ranks-group1"),
         "different strategies (group 0: ddp_ft, group 1: hsdp_ft)"),
        (("fabric-ddp_ft-2groups-1ranks-group0", "someone_else"), "'someone_else', is not a replica group of a fabric job"),
    ],
)
def test_a_quorum_of_groups_set_up_differently_is_refused_naming_the_values(ids: tuple[str, str], said: str) -> None:
    from fabric.strategies.replica_quorum import ReplicaSetupError

    with pytest.raises(ReplicaSetupError) as info:
        _client(_quorum(*ids))._quorum()
    assert said in str(info.value)


def test_a_group_restarted_after_its_peers_finished_does_not_start_over_alone() -> None:
    from fabric.strategies.replica_quorum import ReplicaSetupError

    alone = _quorum("fabric-ddp_ft-2groups-1ranks-group1", max_step=0)
    with pytest.raises(ReplicaSetupError, match=r"replica group 1 had committed 11 step\(s\) before its restart, but the"
                       r" quorum has no other group") as info:
        _client(alone, steps_before=11, group=1)._quorum()
    assert "load the job's checkpoint (fabric.load)" in str(info.value)
    # a peer to heal from, or the job's checkpoint loaded (this group's own step): it goes on
    assert _client(_quorum("fabric-ddp_ft-2groups-1ranks-group1", max_step=30), steps_before=11, group=1)._quorum()
    # a first attempt, or a group that had committed nothing: it may start the job
    assert _client(_quorum("fabric-ddp_ft-2groups-1ranks-group1", max_step=0), steps_before=0, group=1)._quorum()


def test_no_quorum_names_the_lighthouse_whether_it_answers_and_the_bound() -> None:
    from fabric.strategies.replica_quorum import LighthouseLostError

    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(LighthouseLostError) as info:
            _client(TimeoutError("status: Cancelled"), lighthouse=f"http://127.0.0.1:{port}")._quorum()
    message = str(info.value)
    assert f"no quorum from the lighthouse at http://127.0.0.1:{port} within quorum_timeout=7 s" in message
    assert "it does not answer" in message and "raise quorum_timeout" in message and "Cancelled" not in message
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()  # accepts, never answers
        address = f"http://127.0.0.1:{mute.getsockname()[1]}"
        with pytest.raises(LighthouseLostError, match="it accepts connections but gave no quorum"):
            _client(TimeoutError(), lighthouse=address)._quorum()


def test_the_manager_server_asks_the_lighthouse_again_about_once_a_second_over_the_quorum_timeout() -> None:
    import_torchft()
    from fabric.strategies.replica_quorum import quorum_retries

    assert quorum_retries(timedelta(seconds=90)) == 90
    assert quorum_retries(timedelta(seconds=0.5)) == 1


# ---- the healing transfer --------------------------------------------------------------------------------


@pytest.fixture
def transport():
    import_torchft()
    from fabric.strategies.healing_transport import HealingTransport

    served = HealingTransport("127.0.0.1", "s" * 32, timeout=timedelta(seconds=5))
    yield served
    served.shutdown()


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_healing_transfer_serves_only_the_jobs_secret_and_never_puts_it_in_a_url(transport) -> None:
    from fabric.strategies.healing_transport import SECRET_HEADER, HealingTransferError, HealingTransport

    state = {"user": {"weights": torch.arange(6.0)}, "torchft": {"step": 4, "batches_committed": 8}}
    transport.send_checkpoint([1], step=4, state_dict=state, timeout=timedelta(seconds=5))
    address = transport.metadata()
    assert address.startswith("http://127.0.0.1:") and "s" * 32 not in address
    for headers in ({}, {SECRET_HEADER: "t" * 32}, {SECRET_HEADER: ""}):
        status, body = _get(f"{address}4", headers)
        assert status == 403 and b"weights" not in body and b"PK" not in body[:2]
    assert _get(f"{address}4", {SECRET_HEADER: "s" * 32})[0] == 200
    healer = HealingTransport("127.0.0.1", "s" * 32, timeout=timedelta(seconds=5))
    stranger = HealingTransport("127.0.0.1", "x" * 32, timeout=timedelta(seconds=5))
    try:
        received = healer.recv_checkpoint(0, address, step=4, timeout=timedelta(seconds=5))
        assert torch.equal(received["user"]["weights"], torch.arange(6.0)) and received["torchft"]["step"] == 4
        with pytest.raises(HealingTransferError, match=r"refused the healing transfer of step 4 \(403"):
            stranger.recv_checkpoint(0, address, step=4, timeout=timedelta(seconds=5))
    finally:
        healer.shutdown()
        stranger.shutdown()


@pytest.mark.timing
def test_a_transfer_waits_for_its_step_and_the_trainer_waits_for_the_transfer() -> None:
    import_torchft()
    from fabric.strategies.healing_transport import SECRET_HEADER, HealingTransport

    transport = HealingTransport("127.0.0.1", "s" * 32, timeout=timedelta(seconds=1))
    try:
        got: list[int] = []
        url = f"{transport.metadata()}9"
        asking = threading.Thread(target=lambda: got.append(_get(url, {SECRET_HEADER: "s" * 32})[0]))
        asking.start()
        time.sleep(0.3)  # the request arrived before the peer staged the step: it waits, it is not refused
        assert not got
        transport.send_checkpoint([1], step=9, state_dict={"w": torch.zeros(4)}, timeout=timedelta(seconds=1))
        asking.join(5)
        assert got == [200]
        transport.disallow_checkpoint()  # the trainer may change the state now: a new request waits, then is refused
        started = time.monotonic()
        assert _get(url, {SECRET_HEADER: "s" * 32})[0] == 409
        assert 0.9 < time.monotonic() - started < 3
    finally:
        transport.shutdown()


def test_the_healing_server_listens_on_the_jobs_address_only(transport) -> None:
    from support.sockets import listening_addresses

    port = transport._server.server_address[1]
    assert [address for address, bound, _ in listening_addresses([os.getpid()]) if bound == port] == ["127.0.0.1"]


# ---- the step watch ----------------------------------------------------------------------------------------


@pytest.mark.timing
def test_a_rank_that_stalls_beyond_its_bound_is_seen_and_waits_on_others_are_not_stalls(tmp_path: Path) -> None:
    watch = StepWatch(1.0, str(tmp_path), rank=3)
    reader = StepWatchReader(str(tmp_path))
    assert watch.supervised
    watch.beat(committed=7)
    time.sleep(1.2)
    assert reader.look({3: os.getpid()}) is None  # not armed before this process's first step
    assert reader.committed == 7
    watch.arm()
    with watch.waiting():
        time.sleep(1.2)
        assert reader.look({3: os.getpid()}) is None  # waiting on other groups: bounded elsewhere
    assert reader.look({3: os.getpid()}) is None  # progress again as the wait ended
    time.sleep(1.2)
    stall = reader.look({3: os.getpid(), 4: 1})
    assert stall is not None and stall.rank == 3 and stall.seconds > 1.0 and stall.timeout == pytest.approx(1.0)
    assert reader.look({4: 1}) is None  # a rank without a step file is not watched
    reader.close()


def test_the_stall_report_says_how_long_the_bound_and_where() -> None:
    report = describe_stall(Stall(1, 3.25, 3.0), "train.py:12 in <module> (time.sleep(600))")
    assert report == (
        "fabric: rank 1 made no progress for 3.2 s (step_timeout=3 s): it was at train.py:12 in <module>"
        " (time.sleep(600)); it is ended so that its group restarts and heals (raise step_timeout if such a step is"
        " expected)"
    )
    assert "did not answer the request for its stack (stopped" in describe_stall(Stall(0, 9.0, 5.0), None)


# ---- the job's secret and address ----------------------------------------------------------------------------


def test_the_secret_comes_from_the_environment_or_from_one_file_per_lighthouse_for_this_user(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert job_secret("http://10.0.0.5:1", on_loopback=False, env={JOB_SECRET_ENV: "k" * 20}) == "k" * 20
    with pytest.raises(JobSecretError, match=f"{JOB_SECRET_ENV} holds 3 character"):
        job_secret("http://127.0.0.1:1", on_loopback=True, env={JOB_SECRET_ENV: "abc"})
    with pytest.raises(JobSecretError, match=f"is on another machine.*set {JOB_SECRET_ENV}"):
        job_secret("http://10.0.0.5:29510", on_loopback=False, env={})
    first = job_secret("http://127.0.0.1:29510", on_loopback=True, env={})
    assert len(first) == 64 and first == job_secret("http://127.0.0.1:29510", on_loopback=True, env={})
    assert job_secret("http://127.0.0.1:29511", on_loopback=True, env={}) != first
    folder = tmp_path / f"fabric-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in folder.iterdir())
    folder.chmod(0o755)  # another user could plant a secret here: refused
    with pytest.raises(JobSecretError, match="is not a folder that only this user can use"):
        job_secret("http://127.0.0.1:29510", on_loopback=True, env={})


def test_the_job_listens_on_loopback_when_the_lighthouse_is_there_else_on_the_route_to_it() -> None:
    assert replica_job_address("http://127.0.0.1:29510") == "127.0.0.1"
    assert replica_job_address("http://localhost:29510") == "127.0.0.1"
    assert replica_job_address("http://[::1]:29510") == "::1"
    assert lighthouse_on_loopback("http://127.0.0.1:1")
    try:
        remote = replica_job_address("http://192.0.2.7:29510")  # TEST-NET-1: routed (if at all) by the default route
    except OSError:
        return  # no route off this machine at all
    assert remote not in ("0.0.0.0", "127.0.0.1") and not lighthouse_on_loopback("http://192.0.2.7:29510")


# ---- the strategies' timeouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [FaultTolerantStrategy, HSDPFaultTolerantStrategy])
def test_timeouts_take_seconds_or_timedeltas_and_default_beyond_the_step_timeout(strategy) -> None:
    default = strategy()
    assert default.step_timeout == DEFAULT_STEP_TIMEOUT == timedelta(minutes=3)
    assert default._quorum_timeout == default._replica_timeout == timedelta(minutes=4)
    given = strategy(step_timeout=5, quorum_timeout=timedelta(seconds=40), replica_timeout=35.5)
    assert (given.step_timeout, given._quorum_timeout, given._replica_timeout) == (
        timedelta(seconds=5), timedelta(seconds=40), timedelta(seconds=35.5))
    unbounded = strategy(step_timeout=None, quorum_timeout=8)
    assert unbounded.step_timeout is None and unbounded._quorum_timeout == timedelta(seconds=8)
    assert unbounded._replica_timeout == timedelta(seconds=60)


@pytest.mark.parametrize(
    ("kwargs", "error", "said"),
    [
        ({"step_timeout": 60, "quorum_timeout": 60},
         ValueError, "quorum_timeout=60 s is shorter than step_timeout=60 s + 30 s: the other groups would give up"
         " waiting before a hung group is ended. Accepted: quorum_timeout >= 90 s"),
        ({"step_timeout": 10, "replica_timeout": timedelta(seconds=20)}, ValueError,
         "replica_timeout=20 s is shorter than step_timeout=10 s + 30 s"),
        ({"step_timeout": 0}, ValueError, "step_timeout=0 is not valid; accepted: a finite time > 0"),
        ({"quorum_timeout": "60"}, TypeError, "quorum_timeout='60' is not valid; accepted: seconds"),
        ({"step_timeout": True}, TypeError, "step_timeout=True is not valid"),
    ],
)
def test_timeouts_that_would_not_outlast_a_hung_group_are_refused_naming_the_values(kwargs, error, said) -> None:
    with pytest.raises(error) as info:
        FaultTolerantStrategy(**kwargs)
    assert said in str(info.value)


def test_a_group_whose_store_other_machines_cannot_reach_is_refused_naming_the_address(monkeypatch) -> None:
    from fabric.strategies import fault_tolerant

    strategy = FaultTolerantStrategy(cluster_environment=SimpleNamespace(main_address="127.0.0.1"))
    assert strategy._job_address("http://127.0.0.1:29510") == "127.0.0.1"
    monkeypatch.setattr(fault_tolerant, "replica_job_address", lambda url: "10.0.0.7")  # the lighthouse is elsewhere
    with pytest.raises(ValueError, match=r"reach this group's store at its main address, which is 127.0.0.1 \(loopback\);"
                       " give --main-address as this machine's address"):
        strategy._job_address("http://10.0.0.5:29510")
    strategy.cluster_environment = SimpleNamespace(main_address="10.0.0.7")
    assert strategy._job_address("http://10.0.0.5:29510") == "10.0.0.7"

    def unresolvable(url: str) -> str:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(fault_tolerant, "replica_job_address", unresolvable)
    with pytest.raises(ValueError, match=r"the lighthouse at http://nowhere:1 cannot be reached from this machine"):
        strategy._job_address("http://nowhere:1")
