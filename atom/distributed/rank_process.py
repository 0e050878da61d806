"""How rank processes start, live no longer than their caller, and stay on loopback.

Rank processes (the engine's and `run_ranks`') fork from multiprocessing's fork
server, which imports torch once, when the first ranks of a process start, and
serves every later start: a spawned rank spent seconds of CPU importing torch again
(most of a small world's start on a CI machine of two cores), and N ranks held N
copies of its modules. The server's preload is torch alone, which initialises no
device, so every rank still takes its own GPU; not `__main__` (multiprocessing's
default), so the caller's main script is not run in the server. Each rank still
imports that script again under its own name, as spawn did (the engine relies on it
to name a script without the `__main__` guard).

A forked rank is the server's child, and has the environment of the server's start.
It therefore takes both facts from the caller (`CallerLink`): the caller's
environment when it starts the rank, and the read end of a pipe whose write end
only the caller holds. Ranks block on their task queue or in a collective, so
nothing in their own work would notice a caller that was SIGKILLed (the OOM
killer's way), and they would live on holding memory and ports; the kernel closes
the caller's end when it dies, and the rank's watchdog thread exits at that EOF.

All ranks of a world run on this machine, so their rendezvous store and gloo / NCCL
sockets listen on the loopback interface instead of every interface.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import threading
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from pathlib import Path

import torch.distributed as dist

LOOPBACK_HOST = "127.0.0.1"
# linux/if.h: the interface flag of a loopback device.
IFF_LOOPBACK = 0x8
# The socket-interface variables of gloo and NCCL.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
STORE_TIMEOUT = datetime.timedelta(minutes=30)
# What the fork server imports before it forks any rank (module docstring).
FORK_SERVER_PRELOAD = ["torch.distributed"]


def rank_context() -> ForkServerContext:
    """The multiprocessing context of rank processes.

    The preload is the process's one fork server's (multiprocessing keeps one per
    process); it counts when that server starts, with the first ranks.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


def free_port() -> int:
    """A loopback port that was free a moment ago (the store binds it again)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK_HOST, 0))
        return sock.getsockname()[1]


@dataclass
class CallerLink:
    """What a rank takes from the process that started it (module docstring)."""

    environ: dict[str, str]
    # The read end; nothing is ever sent, so it becomes readable only at EOF.
    lifeline: Connection

    def adopt(self) -> None:
        """The rank's first step: the caller's environment, and a watchdog that
        ends this process as soon as the caller is gone."""
        os.environ.clear()
        os.environ.update(self.environ)
        threading.Thread(
            target=_exit_at_eof,
            args=(self.lifeline,),
            name="atom-caller-watch",
            daemon=True,
        ).start()


def link_to_caller(ctx: ForkServerContext) -> tuple[CallerLink, Connection]:
    """(what each rank gets, the pipe's write end). The caller holds the write end,
    and gives it to no other process, for exactly as long as its ranks may live;
    closing it ends them."""
    lifeline, held = ctx.Pipe(duplex=False)
    return CallerLink(dict(os.environ), lifeline), held


def _exit_at_eof(lifeline: Connection) -> None:
    connection.wait([lifeline])
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
