"""Which addresses a process listens on, read from /proc (Linux)."""

from __future__ import annotations

import os
import socket
import struct


def _address(hex_address: str) -> str:
    """``0100007F:1F90`` (IPv4) or a 32-digit IPv6 form from /proc/net/tcp* -> printable address."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = struct.unpack("<4I", raw)  # each 32-bit word is in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening(port: int | None = None, pid: int | None = None) -> list[str]:
    """Addresses of listening TCP sockets, on ``port`` and/or owned by process ``pid``."""
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":  # TCP_LISTEN
                continue
            if port is not None and int(local.split(":")[1], 16) != port:
                continue
            if inodes is not None and inode not in inodes:
                continue
            found.append(_address(local))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
