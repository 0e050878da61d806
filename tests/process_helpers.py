"""What tests ask of processes through /proc: descendants, ranks, liveness, listening
sockets."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp*
# In the command line of multiprocessing's fork server, and so of the rank processes
# it forks (atom/distributed/rank_process.py).
FORK_SERVER = "multiprocessing.forkserver"


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (the fork server, the resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid`: with its children, the ranks its fork server
    forked."""
    found = []
    for child in child_pids(pid):
        found += [child, *descendant_pids(child)]
    return found


def rank_pids(pid: int) -> list[int]:
    """The rank processes of engine process `pid`: its fork server's children."""
    return [
        rank
        for child in child_pids(pid)
        if FORK_SERVER in command_line(child)
        for rank in child_pids(child)
    ]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def survivors(pids: list[int], deadline_s: float) -> list[int]:
    """The `pids` still running once all have ended or `deadline_s` has passed."""
    deadline = time.monotonic() + deadline_s
    while (alive := [pid for pid in pids if is_running(pid)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    return alive


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp* writes it: 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    return ipaddress.ip_address(b"".join(words))


def listening_addresses(pid: int | str = "self") -> list[str]:
    """The addresses process `pid` listens on with TCP."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in sockets:
                found.append(str(_address(local.split(":")[0])))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
