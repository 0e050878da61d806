"""Nodes meet before any rank starts: one store, one check, one verdict.

Node 0's serving process hosts a TCPStore on --master-addr:--master-port, bound to
that address only (never to every interface). Every other node connects, claims its
node rank and posts what it is about to run (the layout facts and the model
fingerprint); node 0 waits for all of them (--join-timeout), compares each with its
own and posts one verdict per node. Only when every verdict is "ok" do the nodes
start their ranks, so a wrong world size or another model is refused before any
weight is loaded. The store carries layout facts and hashes, never secrets; it
still must sit on a trusted network, since anyone who reaches it can join.

Key spaces of the store: `nodes/` for this meeting and the heartbeats
(node_watch.py), `world/` for the ranks' own torch.distributed rendezvous.
"""

from __future__ import annotations

import datetime
import json
import socket
import time

import torch.distributed as dist

from atom.distributed.node_layout import NodeLayout, NodeLayoutError
from atom.distributed.rank_process import STORE_TIMEOUT

POLL_S = 0.2
# How long node 0 waits for the other nodes to read a refusal before it exits
# (and its store with it).
VERDICT_READ_S = 10.0
OK = "ok"


def _listener(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise NodeLayoutError(
            f"node 0 cannot listen on --master-addr {host} --master-port {port}: "
            f"{error.strerror or error}"
        ) from None


def connect_store(layout: NodeLayout, timeout_s: float, host: bool) -> dist.Store:
    """The rendezvous store, served here when `host` (node 0 outside torchrun)."""
    addr, port = layout.master_addr, layout.master_port
    timeout = datetime.timedelta(seconds=timeout_s)
    if host:
        return dist.TCPStore(
            addr,
            port,
            None,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=_listener(addr, port).detach(),
        )
    try:
        return dist.TCPStore(addr, port, None, False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        raise NodeLayoutError(
            f"node {layout.node_rank} could not reach node 0's rendezvous at "
            f"{addr}:{port} within {timeout_s:.0f} s ({error_line(error)})"
        ) from None


def node_store(store: dist.Store) -> dist.Store:
    return dist.PrefixStore("nodes/", store)


def world_store(layout: NodeLayout) -> dist.Store:
    """A rank process's view of the store for init_process_group."""
    store = connect_store(layout, STORE_TIMEOUT.total_seconds(), host=False)
    return dist.PrefixStore("world/", store)


def error_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def first_difference(mine: object, theirs: object, path: str = "") -> str | None:
    """Where two JSON-like facts first differ, as "key path: mine vs theirs" (None
    if equal); a nested dict is named by its "architecture" where it has one."""
    if mine == theirs:
        return None
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(set(mine) | set(theirs)):
            found = first_difference(mine.get(key), theirs.get(key), f"{path} {key}")
            if found is not None:
                return found

    def brief(value: object) -> object:
        return value.get("architecture", "...") if isinstance(value, dict) else value

    return f"{path.strip()}: {brief(mine)} vs {brief(theirs)}"


def facts_difference(mine: dict, theirs: dict) -> str | None:
    """How a node's facts differ from node 0's, in words (None if they agree)."""

    def world(facts: dict) -> str:
        return (
            f"world size {facts['world_size']} (pp {facts['pipeline_parallel_size']}"
            f" x tp {facts['tensor_parallel_size']}, {facts['nnodes']} nodes)"
        )

    if world(mine) != world(theirs):
        return f"{world(theirs)} instead of node 0's {world(mine)}"
    if theirs["backend"] != mine["backend"]:
        return (
            f"ranks on {theirs['backend']} instead of node 0's {mine['backend']} "
            "(nccl needs a GPU per rank on every node)"
        )
    for name, value in mine["settings"].items():
        if theirs["settings"].get(name) != value:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {theirs['settings'].get(name)} instead of node 0's {value}"
    difference = first_difference(theirs["model"], mine["model"])
    if difference is not None:
        return f"another model: {difference} (this node's vs node 0's)"
    return None


def _wait_for(store: dist.Store, keys: list[str], timeout_s: float) -> list[str]:
    """The keys still missing after `timeout_s` (polled, so the caller can name
    them)."""
    deadline = time.monotonic() + timeout_s
    while (missing := [k for k in keys if not store.check([k])]) and (
        time.monotonic() < deadline
    ):
        time.sleep(POLL_S)
    return missing


def meet_as_head(store: dist.Store, layout: NodeLayout, facts: dict) -> None:
    """Node 0: wait for every node, compare, post the verdicts; raise on refusal."""
    others = list(range(1, layout.nnodes))
    missing = _wait_for(store, [f"facts/{n}" for n in others], layout.join_timeout)
    if missing:
        names = ", ".join(key.split("/")[1] for key in missing)
        raise NodeLayoutError(
            f"node {names} did not join the rendezvous at {layout.master_addr}:"
            f"{layout.master_port} within {layout.join_timeout:.0f} s (--join-timeout)"
        )
    problems = {}
    for node in others:
        theirs = json.loads(store.get(f"facts/{node}"))
        difference = facts_difference(facts, theirs)
        if difference is not None:
            problems[node] = f"node {node} refused: {difference}"
    refusal = "; ".join(problems.values())
    for node in others:
        verdict = problems.get(node) or (refusal and f"node 0 refused: {refusal}")
        store.set(f"verdict/{node}", verdict or OK)
    if refusal:
        _wait_for(store, [f"read/{n}" for n in others], VERDICT_READ_S)
        raise NodeLayoutError(refusal)


def meet_as_member(store: dist.Store, layout: NodeLayout, facts: dict) -> None:
    """A node other than 0: claim the node rank, post the facts, obey the verdict."""
    node = layout.node_rank
    if store.add(f"claim/{node}", 1) > 1:
        raise NodeLayoutError(f"another process already joined as --node-rank {node}")
    store.set(f"facts/{node}", json.dumps(facts))
    if _wait_for(store, [f"verdict/{node}"], layout.join_timeout):
        raise NodeLayoutError(
            f"node 0 gave node {node} no verdict within {layout.join_timeout:.0f} s "
            "(--join-timeout): do both nodes use the same --nnodes?"
        )
    verdict = store.get(f"verdict/{node}").decode()
    store.add(f"read/{node}", 1)
    if verdict != OK:
        raise NodeLayoutError(verdict)
