"""The TCP sockets a set of processes listens on, read from /proc (no `ss` needed; Linux only)."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # the state column of /proc/net/tcp{,6}


def _address(hex_address: str, family: int) -> str:
    """``0100007F`` -> ``127.0.0.1``: /proc prints each 32-bit word of the address in host byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(socket.inet_ntop(family, words)))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process ended
        pass
    return inodes


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (from each process's /proc/PID/task/*/children)."""
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in children.read_text().split())
            except OSError:
                pass
    return found


def listening_addresses(pids: list[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket the processes ``pids`` hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    listening = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in owner:
                hex_address, hex_port = local.split(":")
                listening.add((_address(hex_address, family), int(hex_port, 16), owner[inode]))
    return listening


def not_on_loopback(listening: set[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return sorted(entry for entry in listening if not ipaddress.ip_address(entry[0]).is_loopback)
