"""What every rank process does to live no longer than its parent, on loopback only.

Rank processes (the engine's and `run_ranks`') block on their task queue or in a
collective, so nothing in their own work notices a parent that was SIGKILLed (the
OOM killer's way). They would live on, reparented, holding memory and ports. An
engine rank therefore asks the kernel for SIGKILL when its parent goes (Linux
`prctl`) and also runs a watchdog thread that notices a changed parent pid (any
POSIX system). A `run_ranks` rank is forked by a fork server, not by its caller, so
it watches a pipe of which only the caller holds the write end (`die_with_caller`).

All ranks of a world run on this machine, so their rendezvous store and gloo / NCCL
sockets listen on the loopback interface instead of every interface.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing import connection
from multiprocessing.connection import Connection
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

LOOPBACK_HOST = "127.0.0.1"
# How often the watchdog looks for its parent; a rank outlives it by at most this.
PARENT_POLL_S = 0.5
# linux/prctl.h
PR_SET_PDEATHSIG = 1
# linux/if.h: the interface flag of a loopback device.
IFF_LOOPBACK = 0x8
# The socket-interface variables of gloo and NCCL.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
STORE_TIMEOUT = datetime.timedelta(minutes=30)


def free_port() -> int:
    """A loopback port that was free a moment ago (the store binds it again)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK_HOST, 0))
        return sock.getsockname()[1]


def die_with_parent(parent_pid: int) -> None:
    """End this process as soon as `parent_pid` is no longer its parent.

    The kernel signal follows the parent *thread* that started this process, which
    is the engine's own thread or the caller of `run_ranks`; both outlive the ranks
    they start. The watchdog covers systems without `prctl`.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning(
                "prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno())
            )
    # The parent may have died before the request above took effect.
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(
        target=_exit_when_orphaned,
        args=(parent_pid,),
        name="atom-parent-watch",
        daemon=True,
    ).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)  # the main thread may be stuck in a collective: no clean unwind


def die_with_caller(lifeline: Connection) -> None:
    """End this process as soon as the process that holds the write end of
    `lifeline` (a one-way pipe) is gone, whichever process forked this one.

    Only the caller holds that end, so the read end reaches EOF exactly when the
    caller closes it, exits or dies: the kernel closes it even after SIGKILL.
    """
    threading.Thread(
        target=_exit_at_eof, args=(lifeline,), name="atom-caller-watch", daemon=True
    ).start()


def _exit_at_eof(lifeline: Connection) -> None:
    connection.wait([lifeline])  # nothing is ever sent: readable means EOF
    os._exit(1)  # the main thread may be stuck in a collective: no clean unwind


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (`lo` on Linux), if known."""
    for flags in sorted(Path("/sys/class/net").glob("*/flags")):
        try:
            if int(flags.read_text(), 16) & IFF_LOOPBACK:
                return flags.parent.name
        except (OSError, ValueError):
            continue
    return None


def use_loopback_sockets() -> None:
    """Make gloo and NCCL open their sockets on loopback, unless the user chose."""
    interface = loopback_interface()
    if interface is None:
        return
    for variable in SOCKET_IFNAME_VARIABLES:
        os.environ.setdefault(variable, interface)


def loopback_store(rank: int, world_size: int, port: int) -> dist.TCPStore:
    """The world's rendezvous store on LOOPBACK_HOST:`port`, served by rank 0.

    Left to itself the store's server listens on every interface; handing it a
    socket bound to loopback keeps it local.
    """
    if rank != 0:
        return dist.TCPStore(
            LOOPBACK_HOST, port, world_size, False, timeout=STORE_TIMEOUT
        )
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK_HOST, port))
    listener.listen()
    return dist.TCPStore(
        LOOPBACK_HOST,
        port,
        world_size,
        True,
        timeout=STORE_TIMEOUT,
        master_listen_fd=listener.detach(),
    )
