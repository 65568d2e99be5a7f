"""Where a job's stores listen: on loopback when the job runs on one machine, on one interface otherwise.

torch's ``TCPStore`` server, left to itself, listens on every interface of the machine, and anyone who
can reach the port can read and write the store (there is no authentication) while the job runs. The
job's stores (rank 0's store for the ranks' rendezvous, the store of ``fabric run``'s node rendezvous)
therefore listen on a socket opened here and handed to the store (``TCPStore(master_listen_fd=...)``):

* a job whose ranks all run on this machine: loopback only (``127.0.0.1``, or ``::1`` when the main
  address is an IPv6 address), and every rank connects there, whatever the main address says;
* a job over several machines: only the interface that holds the main address. Where that cannot be
  (the main address is ``0.0.0.0``, a name that resolves to loopback here but not elsewhere, or an
  address this machine does not hold, as behind NAT), the store listens on every interface as before,
  and :attr:`StoreListener.why_everywhere` says why, for the caller to tell the user.

:func:`tcp_store_arguments` gives the keyword arguments of ``torch.distributed.TCPStore`` for such a
store (those of torch's own ``env://`` and c10d rendezvous stores, plus the socket), so that the
strategies and ``fabric run``'s node rendezvous create it alike.

Standard library only: ``fabric run`` uses it before any torch import, and the callers create the store.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "EVERY_INTERFACE_ADVICE",
    "LOOPBACK_IPV4",
    "LOOPBACK_IPV6",
    "StoreListener",
    "keep_gloo_on_loopback",
    "lighthouse_address",
    "lighthouse_on_loopback",
    "listen_for_store",
    "loopback_interface",
    "replica_job_address",
    "store_host",
    "tcp_store_arguments",
]

EVERY_INTERFACE_ADVICE = (
    "anyone who can reach that port can read and write the store while the job runs: keep the machines"
    " on a trusted network, or firewall the port (README, 'What listens on the network')"
)

LOOPBACK_IPV4 = "127.0.0.1"
LOOPBACK_IPV6 = "::1"
# Names that can only mean this machine (RFC 6761): a job that gives one as its main address runs here.
_LOCAL_NAMES = ("localhost", "localhost.", "ip6-localhost", "ip6-loopback")


def _literal(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None


def _bare(main_address: str) -> str:
    """The address without the brackets of an IPv6 literal (``[::1]`` -> ``::1``) or spaces."""
    address = main_address.strip()
    return address[1:-1] if address.startswith("[") and address.endswith("]") else address


def store_host(main_address: str, single_machine: bool) -> str:
    """The address every rank connects to for the store: loopback for a one-machine job, else the main address."""
    address = _bare(main_address)
    if not single_machine:
        return address
    literal = _literal(address)
    return LOOPBACK_IPV6 if literal is not None and literal.version == 6 else LOOPBACK_IPV4


@dataclass
class StoreListener:
    """A store's listening socket, or why the store listens on every interface instead."""

    #: where every rank (and the store's own client in the server process) connects
    host: str
    #: bound to ``host``'s interface and listening; None: the store opens its own on every interface
    sock: socket.socket | None = None
    #: why the store listens on every interface; None when ``sock`` is set, or when the port is taken
    #: (then the store either shares this process's own server on the port or reports the port as in use)
    why_everywhere: str | None = None

    def take_fd(self) -> int | None:
        """The listening descriptor, handed over: the store closes it when it ends (None: no socket)."""
        if self.sock is None:
            return None
        fd = self.sock.detach()
        self.sock = None
        return fd

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _listen(family: int, sockaddr: tuple) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if sys.platform != "win32":
            # a restarted attempt reuses the port while the old attempt's connections sit in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock  # close-on-exec (Python's default): the ranks this process starts never inherit it


def _is_loopback(address: str) -> bool:
    literal = _literal(address)
    return literal is not None and literal.is_loopback


def listen_for_store(main_address: str, port: int, single_machine: bool) -> StoreListener:
    """Open the listening socket of the job's store on ``port`` (see the module's rules for where).

    Raises ``OSError`` only for what torch's own store would fail on as well (e.g. a port number out of
    range); a port already in use gives a listener without a socket, so that the store reports it (or
    shares this process's own server on that port, as torch's multi-tenant stores do).
    """
    address = _bare(main_address)
    host = store_host(main_address, single_machine)
    if single_machine:
        candidates = [host]
    elif address in ("", "0.0.0.0", "::", "*"):
        return StoreListener(host, why_everywhere=f"the main address {main_address!r} names every interface")
    elif _literal(address) is not None:
        candidates = [address]
    else:
        try:
            infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        except OSError as err:  # the store resolves the name itself and reports the failure
            return StoreListener(host, why_everywhere=f"the main address {main_address!r} cannot be resolved here ({err})")
        resolved = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if address.lower() not in _LOCAL_NAMES and all(_is_loopback(ip) for ip in resolved):
            return StoreListener(host, why_everywhere=(
                f"the main address {main_address!r} resolves to loopback on this machine ({', '.join(resolved)}),"
                " which the other machines cannot reach; give --main-address as this machine's IP address"
            ))
        candidates = resolved
    not_here = []
    for candidate in candidates:
        literal = _literal(candidate)
        family = socket.AF_INET6 if literal is not None and literal.version == 6 else socket.AF_INET
        try:
            sockaddr = socket.getaddrinfo(candidate, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)[0][4]
            return StoreListener(host, _listen(family, sockaddr))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return StoreListener(host)
            if err.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and not isinstance(err, socket.gaierror):
                raise
            not_here.append(candidate)
    return StoreListener(host, why_everywhere=(
        f"the main address {main_address!r} ({', '.join(not_here)}) is not an address of this machine"
        " (behind NAT, or a name for another machine)"
    ))


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux), or None where unknown."""
    root = "/sys/class/net"  # Linux; elsewhere the name is not guessed
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(root, name, "flags")) as handle:
                flags = int(handle.read().strip(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return None


def _use_libuv() -> bool:
    """torch's rule for its own stores: the libuv server unless ``USE_LIBUV=0`` (Windows: only with ``USE_LIBUV=1``)."""
    default = "0" if sys.platform == "win32" else "1"
    return os.environ.get("USE_LIBUV", default) == "1"


def tcp_store_arguments(
    main_address: str,
    port: int,
    *,
    is_server: bool,
    single_machine: bool,
    timeout: timedelta,
    world_size: int | None = None,
    warn: Callable[[str], object] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``torch.distributed.TCPStore`` for the job's store at ``main_address:port``.

    In the process with ``is_server``: the server, on a socket opened here (``master_listen_fd``; the
    store owns it from then on and closes it when it ends or fails), multi-tenant as torch's own; ``warn``
    is told when it has to listen on every interface, and why. Elsewhere: a client of it.
    """
    arguments: dict[str, Any] = {"port": port, "timeout": timeout, "use_libuv": _use_libuv(), "is_master": is_server}
    if world_size is not None:
        arguments["world_size"] = world_size
    if not is_server:
        return {"host_name": store_host(main_address, single_machine), **arguments}
    listener = listen_for_store(main_address, port, single_machine)
    if listener.why_everywhere is not None and warn is not None:
        warn(f"the job's store listens on every network interface (port {port}): {listener.why_everywhere};"
             f" {EVERY_INTERFACE_ADVICE}")
    fd = listener.take_fd()
    if fd is not None:
        arguments["master_listen_fd"] = fd
    return {"host_name": listener.host, "multi_tenant": True, **arguments}


def keep_gloo_on_loopback() -> None:
    """For a one-machine job: gloo's own sockets on the loopback interface too (``GLOO_SOCKET_IFNAME``).

    gloo listens on the address the machine's name resolves to unless ``GLOO_SOCKET_IFNAME`` names an
    interface; a value the user set is kept. Every rank of a one-machine job talks to the others on this
    machine, so loopback reaches them all. Set in the environment because torch creates every later gloo
    group (``new_group``, device meshes, a background save's group) from it. NCCL's bootstrap sockets are
    left to ``NCCL_SOCKET_IFNAME`` (README, "What listens on the network").
    """
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)


def lighthouse_address(lighthouse_url: str) -> tuple[str, int]:
    """(host, port) of ``http://HOST:PORT`` (an IPv6 host without its brackets; port 0 where none is given)."""
    netloc = lighthouse_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = netloc.rpartition(":")
    return _bare(host), int(port) if port.isdigit() else 0


def replica_job_address(lighthouse_url: str) -> str:
    """Where a rank of a fault-tolerant job listens for the other replica groups (its manager, the healing transfer,
    the process group across groups): loopback when the lighthouse is on loopback, since every group then runs on
    this machine; else this machine's address on the route to the lighthouse, the network the groups share.

    ``lighthouse_url``: ``http://HOST:PORT`` (an IPv6 host in brackets). Raises ``OSError`` naming the lighthouse
    when no route to it exists.
    """
    host, port = lighthouse_address(lighthouse_url)
    if _is_loopback(host) or host.lower() in _LOCAL_NAMES:
        return LOOPBACK_IPV6 if ":" in host else LOOPBACK_IPV4
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    if all(_is_loopback(str(info[4][0])) for info in infos):
        return LOOPBACK_IPV6 if infos[0][0] == socket.AF_INET6 else LOOPBACK_IPV4
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)  # a datagram socket's connect sends nothing: it only picks the route
        return str(probe.getsockname()[0])


def lighthouse_on_loopback(lighthouse_url: str) -> bool:
    """Whether every replica group of the job runs on this machine (they meet at a lighthouse on loopback)."""
    return replica_job_address(lighthouse_url) in (LOOPBACK_IPV4, LOOPBACK_IPV6)
