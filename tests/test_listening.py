"""What a job listens on: every socket of a one-machine job on loopback, a multi-machine store on one interface.

The rules (``fabric._core.listening``) are checked in-process against real sockets; then real jobs
(`fabric run`, ``fabric.launch()`` re-running the script, ``ddp_spawn``, and two `fabric run` "nodes" with
their node rendezvous) are started, and while their ranks hold still inside the process group the
test reads every listening TCP socket of the job's processes from /proc.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path

import pytest

from fabric._core import listening
from fabric._core.listening import keep_gloo_on_loopback, listen_for_store, loopback_interface, store_host, tcp_store_arguments
from support import PYTHON
from support.environment import clean_env, free_port
from support.loading import script_path
from support.processes import fabric_run, finish, read_ranks, start, wait_for_files
from support.sockets import descendants, listening_addresses, not_on_loopback

pytestmark = pytest.mark.cold

if not sys.platform.startswith("linux"):
    pytest.skip("the listening sockets are read from /proc", allow_module_level=True)

HOLD_JOB = script_path("sockets", "hold_job.py")


def create_tcp_store(*args, **kwargs):
    from torch.distributed import TCPStore

    return TCPStore(**tcp_store_arguments(*args, **kwargs))


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def _this_machines_address() -> str | None:
    """A non-loopback IPv4 address of this machine (the route's source address; a UDP connect sends nothing)."""
    for target in ("192.0.2.1", "10.255.255.255", "8.8.8.8"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((target, 9))
                address = sock.getsockname()[0]
        except OSError:
            continue
        if not address.startswith("127."):
            return address
    return None


# ---- the rules ------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("main_address", ["127.0.0.1", "10.1.2.3", "node0.example", "localhost"])
def test_a_one_machine_store_listens_on_loopback_whatever_the_main_address(main_address: str) -> None:
    listener = listen_for_store(main_address, 0, single_machine=True)
    assert listener.sock is not None and listener.why_everywhere is None
    try:
        assert listener.sock.getsockname()[0] == "127.0.0.1" == listener.host == store_host(main_address, True)
    finally:
        listener.close()


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_main_address_gives_the_ipv6_loopback() -> None:
    listener = listen_for_store("[fd00::7]", 0, single_machine=True)
    try:
        assert listener.sock is not None and listener.sock.getsockname()[0] == "::1" == listener.host
    finally:
        listener.close()


@pytest.mark.timeout(30)
def test_a_multi_machine_store_listens_on_the_main_addresss_interface_only() -> None:
    for address in ("127.0.0.1", "localhost", _this_machines_address()):
        if address is None:
            continue
        listener = listen_for_store(address, 0, single_machine=False)
        try:
            assert listener.sock is not None and listener.why_everywhere is None, address
            bound = listener.sock.getsockname()[0]
            assert bound == socket.gethostbyname(address), address
            assert listener.host == address  # the other machines connect to the address given
        finally:
            listener.close()


@pytest.mark.timeout(30)
def test_where_the_interface_cannot_be_bound_the_store_listens_everywhere_and_says_why(monkeypatch) -> None:
    cases = {
        "0.0.0.0": "names every interface",
        "198.51.100.7": "is not an address of this machine",  # TEST-NET-2: no machine holds it
    }
    for address, why in cases.items():
        listener = listen_for_store(address, 0, single_machine=False)
        assert listener.sock is None and why in str(listener.why_everywhere), (address, listener)
        assert repr(address) in str(listener.why_everywhere)

    # a name that resolves to loopback here (a Debian-style /etc/hosts) but to a real address elsewhere
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host == "node0.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(listening.socket, "getaddrinfo", resolve)
    listener = listen_for_store("node0.example", 0, single_machine=False)
    assert listener.sock is None and "resolves to loopback on this machine (127.0.1.1)" in str(listener.why_everywhere)


@pytest.mark.timeout(30)
def test_a_port_in_use_is_left_to_the_store_to_report() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        listener = listen_for_store("127.0.0.1", port, single_machine=True)
        assert listener.sock is None and listener.why_everywhere is None
        with pytest.raises(RuntimeError, match=r"(?i)address already in use|EADDRINUSE"):
            create_tcp_store("127.0.0.1", port, is_server=True, single_machine=True,
                             timeout=datetime.timedelta(seconds=5))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_libuv", ["1", "0"])
def test_torchs_store_serves_on_the_socket_handed_to_it(monkeypatch, use_libuv: str) -> None:
    """``TCPStore(master_listen_fd=...)`` with either server; the store owns (and closes) the descriptor."""
    monkeypatch.setenv("USE_LIBUV", use_libuv)
    port = free_port()
    warned: list[str] = []
    server = create_tcp_store("127.0.0.1", port, is_server=True, single_machine=True,
                              timeout=datetime.timedelta(seconds=20), warn=warned.append)
    client = create_tcp_store("10.9.8.7", port, is_server=False, single_machine=True,  # connects to loopback
                              timeout=datetime.timedelta(seconds=20))
    client.set("key", "value")
    assert server.get("key") == b"value" and server.libuvBackend == (use_libuv == "1")
    assert not warned
    listening_now = listening_addresses([os.getpid()])
    assert ("127.0.0.1", port, os.getpid()) in listening_now
    del client, server
    assert ("127.0.0.1", port, os.getpid()) not in listening_addresses([os.getpid()])


@pytest.mark.timeout(30)
def test_gloo_is_kept_on_the_loopback_interface_unless_the_user_chose_one(monkeypatch) -> None:
    assert loopback_interface() == "lo"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    keep_gloo_on_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    keep_gloo_on_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"


# ---- real jobs ------------------------------------------------------------------------------------------


def _hold_and_read(procs: list, out: Path, ranks: int) -> set[tuple[str, int, int]]:
    """Wait until every rank holds inside the process group, read the job's listening sockets, let it end."""
    try:
        wait_for_files(out, "rank*.json", ranks, timeout=90)
        listening_now = listening_addresses(descendants([proc.pid for proc in procs]))
    finally:
        (out / "go").write_text("")
    for node, (code, _, err) in enumerate(finish(procs, timeout=60)):
        assert code == 0, f"process {node} exited with {code}:\n{err[-4000:]}"
    return listening_now


@pytest.mark.procs
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["fabric run", "launch() popen", "launch(fn) spawn"])
def test_a_one_machine_job_listens_on_loopback_only(tmp_path: Path, how: str) -> None:
    command = {
        "fabric run": fabric_run("--accelerator", "cpu", "--devices", 2, HOLD_JOB, tmp_path),
        "launch() popen": [PYTHON, str(HOLD_JOB), str(tmp_path), "--strategy", "ddp", "--devices", "2"],
        "launch(fn) spawn": [PYTHON, str(HOLD_JOB), str(tmp_path), "--strategy", "ddp_spawn", "--devices", "2"],
    }[how]
    listening_now = _hold_and_read([start(command, env=clean_env(OMP_NUM_THREADS="1"))], tmp_path, 2)
    ranks = read_ranks(tmp_path)
    store = ("127.0.0.1", ranks[0]["master_port"], ranks[0]["pid"])
    assert store in listening_now, listening_now  # rank 0's store: found, and on loopback
    assert not not_on_loopback(listening_now), listening_now
    for record in ranks.values():
        assert record["ifname"]["GLOO_SOCKET_IFNAME"] == "lo"


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_two_nodes_with_their_node_rendezvous_listen_on_the_main_address_only(tmp_path: Path) -> None:
    """`--num-nodes 2 --max-restarts 1` on 127.0.0.1: the node rendezvous's store (in node 0's `fabric run`),
    no second store of torch's, and rank 0's store all listen on 127.0.0.1."""
    port = free_port()
    procs = [
        start(fabric_run("--accelerator", "cpu", "--devices", 1, "--num-nodes", 2, "--node-rank", node,
                         "--main-address", "127.0.0.1", "--main-port", port, "--max-restarts", 1, HOLD_JOB, tmp_path),
              env=clean_env(OMP_NUM_THREADS="1"))
        for node in (0, 1)
    ]
    listening_now = _hold_and_read(procs, tmp_path, 2)
    assert ("127.0.0.1", port, procs[0].pid) in listening_now, listening_now  # the node rendezvous's store
    assert not [entry for entry in listening_now if entry[2] in (procs[0].pid, procs[1].pid) and entry[1] != port]
    ranks = read_ranks(tmp_path)
    assert ("127.0.0.1", ranks[0]["master_port"], ranks[0]["pid"]) in listening_now
    assert not not_on_loopback(listening_now), listening_now
