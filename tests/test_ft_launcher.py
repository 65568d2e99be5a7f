"""Fault tolerance across replica groups, the launcher's part: `fabric-torch lighthouse` and `fabric-torch run --replica-group`.

In-process: the options' checks (exit status 2, the value and what is accepted named), the lighthouse's defaults
(127.0.0.1:29510), its message without torchft (the `ft` extra named, exit 1) and for a port it cannot bind (a
stand-in for torchft's server), the three variables `fabric run` hands to the ranks, and the per-group id of the
nodes' rendezvous. In processes: a real lighthouse on a free port (`--port 0`) prints its address, answers there
(torchft's dashboard), listens on 127.0.0.1 only, and ends with status 0 soon after SIGTERM or SIGINT; a real
`fabric-torch run` hands TORCHFT_LIGHTHOUSE, FABRIC_REPLICA_GROUP and FABRIC_NUM_REPLICA_GROUPS to its rank, and to
every attempt after a restart.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fabric import cli, run_options
from fabric.supervision import lighthouse
from support import PYTHON
from support.loading import script_path
from support.processes import fabric_run, run, start
from support.sockets import listening_addresses

RANKS_ENV = script_path("multinode", "ranks_env.py")  # any existing script: parsing checks only that SCRIPT exists
GROUP = ["--replica-group", "1", "--num-replica-groups", "2", "--lighthouse", "127.0.0.1:1234"]
LINE = re.compile(r"^\[fabric\] lighthouse listening on (http://127\.0\.0\.1:(\d+)) \(min replicas 2\)$")
# prints the three variables as JSON and, with --fail-first, fails its first attempt (a restart gives a second)
SHOW_VARIABLES = """\
import json, os, sys
names = ("TORCHFT_LIGHTHOUSE", "FABRIC_REPLICA_GROUP", "FABRIC_NUM_REPLICA_GROUPS", "TORCHELASTIC_RESTART_COUNT")
print(json.dumps({name: os.environ.get(name) for name in names}), flush=True)
sys.exit(3 if "--fail-first" in sys.argv and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" else 0)
"""


def _exit(call: Any, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """The exit status, stdout and stderr of ``call()``, which ends in SystemExit."""
    with pytest.raises(SystemExit) as info:
        call()
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


# ---- the lighthouse's options ------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_lighthouse_defaults_to_loopback_and_port_29510() -> None:
    config = lighthouse.parse_lighthouse_args(["--min-replicas", "2"])
    assert (config.host, config.port, config.min_replicas) == ("127.0.0.1", 29510, 2)
    assert (config.join_timeout_ms, config.quorum_tick_ms) == (None, None)  # torchft's
    assert config.heartbeat_timeout_ms == 750  # ours: a death costs the other groups at most 1 s beyond one step
    assert config.bind == "127.0.0.1:29510" and config.url(29510) == "http://127.0.0.1:29510"
    every = lighthouse.parse_lighthouse_args(
        ["--min-replicas", "1", "--host", "0.0.0.0", "--port", "0", "--join-timeout-ms", "0", "--quorum-tick-ms", "50",
         "--heartbeat-timeout-ms", "2000"])
    assert (every.bind, every.join_timeout_ms, every.quorum_tick_ms, every.heartbeat_timeout_ms) == ("0.0.0.0:0", 0, 50, 2000)
    assert every.url(4321) == f"http://{socket.gethostname()}:4321"  # every interface: peers need this machine's name
    ipv6 = lighthouse.parse_lighthouse_args(["--min-replicas", "1", "--host", "[::1]", "--port", "0"])
    assert ipv6.bind == "[::1]:0" and ipv6.url(80) == "http://[::1]:80"


@pytest.mark.timeout(10)
def test_lighthouse_help_and_the_top_level_help_list_the_command(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _exit(lambda: cli.main(["lighthouse", "--help"]), capsys)
    out = " ".join(out.split())
    assert code == 0 and out.startswith("usage: fabric-torch lighthouse")
    for text in ("--min-replicas", "--host", "--port", "--join-timeout-ms", "--quorum-tick-ms", "--heartbeat-timeout-ms",
                 "Default: 127.0.0.1", "Default: 29510", "fabric-torch run --replica-group G", "pip install 'fabric-torch[ft]'"):
        assert text in out, text
    code, out, _ = _exit(lambda: cli.main(["--help"]), capsys)
    assert code == 0 and "fabric-torch lighthouse --help" in out
    code, _, err = _exit(lambda: cli.main(["nope"]), capsys)
    assert code == 2 and "accepted: run, consolidate, lighthouse" in err


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], ["required", "--min-replicas"]),
        (["--min-replicas", "0"], ["--min-replicas='0'", "an integer >= 1"]),
        (["--min-replicas", "two"], ["--min-replicas='two'", "an integer >= 1"]),
        (["--min-replicas", "2", "--port", "65536"], ["--port='65536'", "an integer in 0..65535", "0: any free port"]),
        (["--min-replicas", "2", "--port", "-1"], ["--port='-1'", "0..65535"]),
        (["--min-replicas", "2", "--port", "http"], ["--port='http'", "0..65535"]),
        (["--min-replicas", "2", "--host", " "], ["--host=' '", "host name or IP address"]),
        (["--min-replicas", "2", "--host", "http://10.0.0.1"], ["--host='http://10.0.0.1'", "host name or IP address"]),
        (["--min-replicas", "2", "--quorum-tick-ms", "0"], ["--quorum-tick-ms='0'", "an integer >= 1"]),
        (["--min-replicas", "2", "--heartbeat-timeout-ms", "0"], ["--heartbeat-timeout-ms='0'", "an integer >= 1"]),
        (["--min-replicas", "2", "--join-timeout-ms", "-5"], ["--join-timeout-ms='-5'", "an integer >= 0"]),
        (["--min-replicas", "2", "--replicas", "2"], ["unrecognized arguments: --replicas"]),
    ],
)
def test_bad_lighthouse_values_exit_2_naming_value_and_accepted(args: list[str], expected: list[str],
                                                                capsys: pytest.CaptureFixture) -> None:
    code, _, err = _exit(lambda: cli.main(["lighthouse", *args]), capsys)
    assert code == 2
    assert "usage: fabric-torch lighthouse" in err  # the command as called, as argparse says it
    for text in expected:
        assert text in err, err


@pytest.mark.timeout(10)
def test_without_torchft_the_extra_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft...` now fails as if it were not installed
    monkeypatch.setitem(sys.modules, "torchft.coordination", None)
    assert lighthouse.main(["--min-replicas", "2", "--port", "0"], prog="fabric-torch lighthouse") == 1
    err = capsys.readouterr().err
    assert "torchft is not installed" in err and "pip install 'fabric-torch[ft]'" in err, err


@pytest.mark.timeout(10)
def test_a_port_it_cannot_bind_exits_1_naming_the_address(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    binds: list[str] = []

    class TakenPort:  # torchft's server, as it fails on a port in use
        def __init__(self, bind: str, **settings: Any) -> None:
            binds.append(bind)
            raise RuntimeError("Address already in use (os error 98)")

    monkeypatch.setitem(sys.modules, "torchft.coordination", types.SimpleNamespace(LighthouseServer=TakenPort))
    assert lighthouse.main(["--min-replicas", "2", "--port", "29999"]) == 1
    err = capsys.readouterr().err
    assert binds == ["127.0.0.1:29999"]
    assert "cannot listen on 127.0.0.1:29999: Address already in use" in err and "--port" in err, err
    # the signals it held while starting are back as they were
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


# ---- a real lighthouse ---------------------------------------------------------------------------------


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` writes on stdout, read from the pipe itself within ``timeout`` s."""
    assert proc.stdout is not None
    fd, data, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or (proc.poll() is not None and not select.select([fd], [], [], 0)[0]):
            proc.kill()
            raise AssertionError(f"no line on stdout within {timeout} s (exit {proc.poll()}): {data!r}\n{proc.communicate()}")
        if select.select([fd], [], [], min(left, 0.5))[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                continue
            data += chunk
    return data.decode().splitlines()[0]


@pytest.mark.procs
@pytest.mark.cold  # its subject is the process: what it prints, where it listens, how a signal ends it
@pytest.mark.timing  # ends within seconds of the signal
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_lighthouse_on_a_free_port_answers_on_loopback_and_a_signal_ends_it_with_0(signum: int) -> None:
    proc = start([PYTHON, "-m", "fabric", "lighthouse", "--min-replicas", "2", "--port", "0"])
    try:
        line = _first_line(proc, timeout=60)  # importing torchft (and torch) in a fresh interpreter
        match = LINE.match(line)
        assert match, line
        url, port = match.group(1), int(match.group(2))
        assert port != 29510
        # torchft's lighthouse answers there: its dashboard (no proxy from the environment in between)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url + "/", timeout=10) as page:
            assert page.status == 200 and "Lighthouse" in page.read().decode()
        # it listens on 127.0.0.1 alone: the one port, on loopback, nothing on another interface
        assert {(address, listened) for address, listened, _ in listening_addresses([proc.pid])} == {("127.0.0.1", port)}
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        proc.send_signal(signum)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert took < 10, took
    assert f"received {signal.Signals(signum).name}: the lighthouse stops" in err
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the server is gone with it


# ---- fabric-torch run --replica-group ----------------------------------------------------------------


@pytest.mark.timeout(10)
def test_run_takes_the_three_flags_and_hands_them_to_the_ranks() -> None:
    config = run_options.parse_run_args([*GROUP, str(RANKS_ENV)])
    assert (config.replica_group, config.num_replica_groups, config.lighthouse) == (1, 2, "http://127.0.0.1:1234")
    env = cli.fabric_environment(config, 1)
    assert {name: env[name] for name in ("TORCHFT_LIGHTHOUSE", "FABRIC_REPLICA_GROUP", "FABRIC_NUM_REPLICA_GROUPS")} == {
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1234", "FABRIC_REPLICA_GROUP": "1", "FABRIC_NUM_REPLICA_GROUPS": "2"}
    # HOST:PORT or http://HOST:PORT, in either order with SCRIPT, underscores as the other options take them
    for given, url in (("http://10.0.0.7:29510/", "http://10.0.0.7:29510"), ("[::1]:29510", "http://[::1]:29510"),
                       ("lighthouse.cluster:80", "http://lighthouse.cluster:80")):
        other = run_options.parse_run_args(
            [str(RANKS_ENV), "--replica_group=0", "--num_replica_groups", "1", f"--lighthouse={given}", "--lr", "1"])
        assert (other.replica_group, other.num_replica_groups, other.lighthouse, other.script_args) == (0, 1, url, ["--lr", "1"])
    # without them nothing is added
    plain = cli.fabric_environment(run_options.parse_run_args([str(RANKS_ENV)]), 1)
    assert not {"TORCHFT_LIGHTHOUSE", "FABRIC_REPLICA_GROUP", "FABRIC_NUM_REPLICA_GROUPS"} & set(plain)
    assert run_options.parse_run_args([str(RANKS_ENV)]).lighthouse is None


@pytest.mark.timeout(10)
def test_run_help_lists_the_replica_group_flags(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _exit(lambda: cli.main(["run", "--help"]), capsys)
    out = " ".join(out.split())
    assert code == 0
    for text in ("--replica-group G", "--num-replica-groups R", "--lighthouse HOST:PORT", "ddp_ft", "fabric-torch lighthouse"):
        assert text in out, text


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--replica-group", "0"], ["--replica-group given without --num-replica-groups and --lighthouse", "all three"]),
        (["--replica-group", "0", "--num-replica-groups", "2"], ["given without --lighthouse", "none of them"]),
        (["--num-replica-groups", "2", "--lighthouse", "127.0.0.1:1234"], ["given without --replica-group", "all three"]),
        (["--lighthouse", "127.0.0.1:1234"], ["--lighthouse given without --replica-group and --num-replica-groups"]),
        (["--replica-group", "2", "--num-replica-groups", "2", "--lighthouse", "h:1"],
         ["--replica-group=2 is not valid with --num-replica-groups=2", "accepted: 0 .. 1"]),
        (["--replica-group", "5", "--num-replica-groups", "1", "--lighthouse", "h:1"], ["--replica-group=5", "accepted: 0 .. 0"]),
        (["--replica-group", "-1", "--num-replica-groups", "2", "--lighthouse", "h:1"], ["--replica-group='-1'", "integer >= 0"]),
        (["--replica-group", "0", "--num-replica-groups", "0", "--lighthouse", "h:1"], ["--num-replica-groups='0'", "integer >= 1"]),
        (["--replica-group", "0", "--num-replica-groups", "2", "--lighthouse", "h"], ["--lighthouse='h'", "HOST:PORT"]),
        (["--replica-group", "0", "--num-replica-groups", "2", "--lighthouse", "h:0"], ["--lighthouse='h:0'", "1..65535"]),
        (["--replica-group", "0", "--num-replica-groups", "2", "--lighthouse", "grpc://h:1"], ["'grpc://h:1'", "http://HOST:PORT"]),
        (["--replica-group", "0", "--num-replica-groups", "2", "--lighthouse", "::1:29510"], ["'::1:29510'", "[::1]:29510"]),
    ],
)
def test_bad_replica_group_flags_exit_2_naming_value_and_accepted(args: list[str], expected: list[str],
                                                                  capsys: pytest.CaptureFixture) -> None:
    code, _, err = _exit(lambda: cli.main(["run", *args, str(RANKS_ENV)]), capsys)
    assert code == 2
    for text in expected:
        assert text in err, err


@pytest.mark.timeout(10)
def test_each_group_meets_its_own_nodes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups given the same --main-address and --main-port never share a rendezvous of nodes (nor restarts)."""
    from fabric.supervision import node_rendezvous

    class Stop(Exception):
        pass

    def record(*args: Any, **kwargs: Any) -> None:
        raise Stop(args[4])  # the rendezvous id: what decides which nodes restart together

    monkeypatch.setattr(node_rendezvous, "NodeRendezvous", record)
    ids = {}
    for group in ("0", "1"):
        config = run_options.parse_run_args(
            ["--num-nodes", "2", "--max-restarts", "1", "--main-port", "29411", "--replica-group", group,
             "--num-replica-groups", "2", "--lighthouse", "h:1", str(RANKS_ENV)])
        with pytest.raises(Stop) as info:
            cli.run(config)
        ids[group] = info.value.args[0]
    assert ids == {"0": "fabric-127.0.0.1-29411-replica-group-0", "1": "fabric-127.0.0.1-29411-replica-group-1"}
    # an id the user gives is theirs, and a run without groups keeps the id it always had
    given = run_options.parse_run_args(["--num-nodes", "2", "--max-restarts", "1", "--main-port", "29411", "--rdzv-id", "job7",
                                        *GROUP, str(RANKS_ENV)])
    with pytest.raises(Stop) as info:
        cli.run(given)
    assert info.value.args[0] == "job7"
    with pytest.raises(Stop) as info:
        cli.run(run_options.parse_run_args(["--num-nodes", "2", "--max-restarts", "1", "--main-port", "29411", str(RANKS_ENV)]))
    assert info.value.args[0] is None  # NodeRendezvous derives fabric-127.0.0.1-29411 itself


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_the_rank_gets_the_lighthouse_and_its_group(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(SHOW_VARIABLES)
    result = run(fabric_run(*GROUP, "--accelerator", "cpu", "--devices", "1", script), timeout=50)
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert shown == {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1234", "FABRIC_REPLICA_GROUP": "1",
                     "FABRIC_NUM_REPLICA_GROUPS": "2", "TORCHELASTIC_RESTART_COUNT": None}


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_every_attempt_after_a_restart_gets_them_too(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(SHOW_VARIABLES)
    result = run(fabric_run("--replica-group", "0", "--num-replica-groups", "3", "--lighthouse", "http://127.0.0.1:29510",
                            "--max-restarts", "1", "--accelerator", "cpu", "--devices", "1", script, "--fail-first"),
                 timeout=50)
    attempts = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [attempt.pop("TORCHELASTIC_RESTART_COUNT") for attempt in attempts] == ["0", "1"], result.stderr
    assert attempts == 2 * [{"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "FABRIC_REPLICA_GROUP": "0",
                             "FABRIC_NUM_REPLICA_GROUPS": "3"}]
    assert "restarting the ranks on this node (restart 1 of 1)" in result.stderr
