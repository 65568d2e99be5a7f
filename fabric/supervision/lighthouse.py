"""``fabric-torch lighthouse``: torchft's lighthouse in the foreground, where the replica groups of a ``ddp_ft`` job meet.

A fault-tolerant job is several *replica groups*, each one ordinary ``fabric-torch run --replica-group G
--num-replica-groups R --lighthouse HOST:PORT`` with its own ranks, store and restarts. Their ranks ask the
lighthouse which groups train together (the quorum) and send it heartbeats, so the groups left go on when one dies.
This command runs that server (torchft's ``LighthouseServer``) until it is stopped:

* it prints one line on stdout, flushed, with the address the groups give as ``--lighthouse``:
  ``[fabric] lighthouse listening on http://127.0.0.1:29510 (min replicas 2)`` (with ``--port 0`` the port the
  system chose);
* it listens on ``127.0.0.1`` unless ``--host`` names another address: the lighthouse asks no one who they are,
  so it is reachable from other machines only when asked for (``--host 0.0.0.0`` or ``::``, every interface: the
  line then names this machine by its host name);
* SIGTERM or SIGINT (Ctrl-C) shuts the server down and the command exits 0: that is how it is meant to end; a
  second one while it shuts down ends it at once (status 128 + the signal);
* a bad value exits 2 naming the value and what is accepted, as argparse does; a port that cannot be bound (in use,
  an address not of this machine) exits 1; so does a missing torchft, naming the extra that installs it
  (``pip install 'fabric-torch[ft]'``).

torchft (and torch, which it imports) is imported only once the options are checked: importing this module imports
the standard library alone, as every module of ``fabric.supervision`` (``tests/test_import_cost_guard.py``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_MS",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "FT_EXTRA",
    "LighthouseConfig",
    "build_lighthouse_parser",
    "main",
    "parse_lighthouse_args",
]

#: Loopback: a lighthouse on every interface has to be asked for (``--host 0.0.0.0``).
DEFAULT_HOST = "127.0.0.1"
#: torchft's own lighthouse command listens on this port too.
DEFAULT_PORT = 29510
#: A group whose heartbeat is this late is taken for dead (torchft's own default: 5000). The survivors' next quorum
#: waits for it: with the rest of the dropped step and a quorum tick (100 ms) it is what a death costs them beyond one
#: step, which the docs promise to be at most 1 s; groups heartbeat every 100 ms, so it is 7 missed heartbeats.
DEFAULT_HEARTBEAT_TIMEOUT_MS = 750
#: What installs torchft.
FT_EXTRA = "pip install 'fabric-torch[ft]' (from a checkout of fabric: pip install -e '.[ft]')"
#: The exit status when the server cannot start: torchft missing, or the address cannot be bound.
CANNOT_START_STATUS = 1
#: The addresses that mean every interface: the printed address then names this machine by its host name.
_EVERY_INTERFACE = ("0.0.0.0", "::")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PROG = "fabric-torch lighthouse"


@dataclass(frozen=True)
class LighthouseConfig:
    """The checked options of one ``fabric-torch lighthouse``."""

    min_replicas: int
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: any free port
    join_timeout_ms: int | None = None  # None: torchft's default
    quorum_tick_ms: int | None = None
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS

    @property
    def bind(self) -> str:
        """``HOST:PORT`` as torchft binds it (an IPv6 address in brackets)."""
        return f"{_bracketed(self.host)}:{self.port}"

    def url(self, port: int) -> str:
        """The address peers use, ``http://HOST:PORT``, for the port the server got."""
        host = socket.gethostname() if self.host in _EVERY_INTERFACE else self.host
        return f"http://{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _integer(option: str, low: int, high: int | None = None, meaning: str = "") -> Callable[[str], int]:
    accepted = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"

    def parse(value: str) -> int:
        text = value.strip()
        if text.isascii() and text.isdigit() and low <= int(text) and (high is None or int(text) <= high):
            return int(text)
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not valid; accepted: {accepted}{meaning}")

    return parse


def _host(value: str) -> str:
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(char.isspace() or char in "/[]@?#" for char in host):
        raise argparse.ArgumentTypeError(
            f"--host={value!r} is not valid; accepted: a host name or IP address of this machine (0.0.0.0 or '::':"
            " every interface)"
        )
    return host


_EPILOG = """\
Each replica group is one `{run} --replica-group G --num-replica-groups R --lighthouse HOST:PORT ...`
(for the ddp_ft strategy). The line on stdout gives the address to use. The lighthouse does not check who
connects: it listens on 127.0.0.1 unless --host says otherwise; give the cluster-internal address for groups
on other machines. SIGTERM or Ctrl-C stops it (exit status 0). Exit status 2: a bad value; 1: the server
could not start (the port is taken, the address is not this machine's, or torchft is missing: {extra}).

examples:
  {prog} --min-replicas 2                                  # on 127.0.0.1:{port}
  {prog} --min-replicas 2 --host 10.0.0.1 --port 29510     # for groups on other machines
"""


def build_lighthouse_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    """The parser of ``fabric-torch lighthouse`` (also what ``--help`` prints), ``prog`` being the command as called."""
    run = prog.removesuffix(" lighthouse") + " run"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run torchft's lighthouse, where the replica groups of a fault-tolerant (ddp_ft) job find each"
        " other, until SIGTERM or SIGINT.",
        epilog=_EPILOG.format(prog=prog, run=run, port=DEFAULT_PORT, extra=FT_EXTRA),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--min-replicas", "--min_replicas", dest="min_replicas", required=True, metavar="N",
        type=_integer("--min-replicas", 1, meaning=" (replica groups)"),
        help="The fewest replica groups that make a quorum: training waits until this many have joined.",
    )
    parser.add_argument(
        "--host", type=_host, default=DEFAULT_HOST, metavar="HOST",
        help=f"The address to listen on. Default: {DEFAULT_HOST} (this machine only); 0.0.0.0 or '::': every interface.",
    )
    parser.add_argument(
        "--port", type=_integer("--port", 0, 65535, " (0: any free port)"), default=DEFAULT_PORT, metavar="PORT",
        help=f"The port to listen on; 0 takes any free one (the printed line says which). Default: {DEFAULT_PORT}.",
    )
    parser.add_argument(
        "--join-timeout-ms", "--join_timeout_ms", dest="join_timeout_ms", type=_integer("--join-timeout-ms", 0),
        default=None, metavar="MS",
        help="Once --min-replicas groups have joined, how long to wait for the other heartbeating groups before"
        " the quorum is made. Default: torchft's (60000 in torchft 0.2.0).",
    )
    parser.add_argument(
        "--quorum-tick-ms", "--quorum_tick_ms", dest="quorum_tick_ms", type=_integer("--quorum-tick-ms", 1),
        default=None, metavar="MS",
        help="How often the lighthouse checks whether a quorum can be made. Default: torchft's (100 in torchft 0.2.0).",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms", "--heartbeat_timeout_ms", dest="heartbeat_timeout_ms",
        type=_integer("--heartbeat-timeout-ms", 1), default=DEFAULT_HEARTBEAT_TIMEOUT_MS, metavar="MS",
        help="A group whose heartbeat is this much late is taken for dead; the other groups' next quorum waits that long"
        f" after a death. Groups heartbeat every 100 ms. Default: {DEFAULT_HEARTBEAT_TIMEOUT_MS} (torchft's own: 5000).",
    )
    return parser


def parse_lighthouse_args(argv: Sequence[str], prog: str = _PROG) -> LighthouseConfig:
    """Parse and check ``fabric-torch lighthouse`` arguments; exits with status 2 and a message naming a bad value."""
    args = build_lighthouse_parser(prog).parse_args(list(argv))
    return LighthouseConfig(
        min_replicas=args.min_replicas, host=args.host, port=args.port, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )


def _say(message: str) -> None:
    sys.stderr.write(f"[fabric] {message}\n")
    sys.stderr.flush()


@contextmanager
def _stop_signals() -> Iterator[Callable[[], int]]:
    """Hold SIGTERM and SIGINT from here on; yields the call that waits for one and returns its number.

    They are blocked before torchft starts its threads, which inherit the mask, so the signal waits for this
    thread's ``sigwait`` whichever thread the kernel picks; nothing races between a check and a wait. Once one
    arrived, they are unblocked with their default action: a second one ends the process at once.
    """
    if not hasattr(signal, "pthread_sigmask"):  # no POSIX signal masks (Windows): a handler sets an event
        arrived: list[int] = []
        event = threading.Event()

        def note(signum: int, frame: Any) -> None:
            arrived.append(signum)
            event.set()

        previous = {signum: signal.signal(signum, note) for signum in _STOP_SIGNALS}

        def wait_for_event() -> int:
            while not event.wait(0.5):
                pass
            return arrived[0]

        try:
            yield wait_for_event
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)

    def wait_for_signal() -> int:
        signum = signal.sigwait(_STOP_SIGNALS)
        for stop in _STOP_SIGNALS:
            signal.signal(stop, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return signum

    try:
        yield wait_for_signal
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _port_of(address: str) -> int:
    """The port of torchft's ``http://NAME:PORT`` (it names the machine by host name whatever was bound)."""
    return int(address.rstrip("/").rpartition(":")[2])


def main(argv: Sequence[str], prog: str = _PROG) -> int:
    """Run the lighthouse until SIGTERM or SIGINT; the exit status (0 when stopped by one of them)."""
    config = parse_lighthouse_args(argv, prog)
    with _stop_signals() as wait_for_stop:
        try:
            from torchft.coordination import LighthouseServer
        except ImportError as err:
            missing = isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == "torchft"
            what = "torchft is not installed" if missing else f"torchft could not be imported ({err})"
            _say(f"error: `{prog}` runs torchft's lighthouse, but {what}; install the ft extra: {FT_EXTRA}")
            return CANNOT_START_STATUS
        try:
            server = LighthouseServer(
                bind=config.bind, min_replicas=config.min_replicas, join_timeout_ms=config.join_timeout_ms,
                quorum_tick_ms=config.quorum_tick_ms, heartbeat_timeout_ms=config.heartbeat_timeout_ms,
            )
        except (RuntimeError, OSError, ValueError) as err:
            _say(f"error: the lighthouse cannot listen on {config.bind}: {err}; accepted: a free port (--port, 0: any"
                 " free one) on an address of this machine (--host)")
            return CANNOT_START_STATUS
        try:
            url = config.url(_port_of(server.address()))
            print(f"[fabric] lighthouse listening on {url} (min replicas {config.min_replicas})", flush=True)
            signum = wait_for_stop()
            _say(f"received {signal.Signals(signum).name}: the lighthouse stops")
        finally:
            server.shutdown()
    return 0
