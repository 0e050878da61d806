"""How a rank gets its tasks and sends its messages, on node 0 or on another node.

On node 0 every rank takes tasks from its queue, filled by the engine process, and
puts its messages (the ready report, the last stage's outputs, call results,
errors) on the engine's results queue. Ranks on other nodes reach neither queue.
Global rank 0 therefore rebroadcasts each task it takes to them over one gloo
group, and each of them sends its messages to rank 0 over a gloo pair of its own,
where a forwarding thread per remote rank puts them on the results queue. Only
forward pipeline traffic crosses stages, so rank 0 waiting in that broadcast for a
later stage to finish its previous task cannot deadlock.

A node whose ranks vanish breaks its forwarders' sockets at once (a receive from
one named peer fails when the peer goes, a receive from any peer would wait on);
the forwarder names the node on `lost`, a pipe the engine's monitor waits on beside
its rank processes.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch.distributed as dist

from atom.distributed.node_layout import NodeLayout
from atom.distributed.parallel_state import GroupCoordinator

logger = logging.getLogger(__name__)

CLOSED = "closed"
# How long rank 0 waits at shutdown for the other nodes' ranks to say goodbye.
CLOSE_WAIT_S = 10.0


class RankChannel(Protocol):
    def next_task(self) -> Any: ...

    def put(self, message: tuple) -> None: ...

    def close(self) -> None: ...


class LocalChannel:
    """A rank on node 0: its task queue and the engine's results queue."""

    def __init__(self, tasks: Any, results: Any) -> None:
        self.tasks, self.results = tasks, results

    def next_task(self) -> Any:
        return self.tasks.get()

    def put(self, message: tuple) -> None:
        self.results.put(message)

    def close(self) -> None:
        pass


class HeadChannel(LocalChannel):
    """Global rank 0 of a multi-node world: relays tasks out, messages in."""

    def __init__(
        self,
        tasks: Any,
        results: Any,
        control: GroupCoordinator,
        reports: dict[int, GroupCoordinator],
        layout: NodeLayout,
        lost: Connection,
    ) -> None:
        super().__init__(tasks, results)
        self.control = control
        self.layout = layout
        self.lost = lost
        self.forwarders = [
            threading.Thread(
                target=self._forward,
                args=(rank, group),
                name=f"atom-rank{rank}-reports",
                daemon=True,
            )
            for rank, group in reports.items()
        ]
        for thread in self.forwarders:
            thread.start()

    def next_task(self) -> Any:
        task = self.tasks.get()
        self.control.broadcast_object(task, src=0)
        return task

    def _forward(self, rank: int, group: GroupCoordinator) -> None:
        try:
            while (message := group.recv_object(rank))[0] != CLOSED:
                self.results.put(message)
        except Exception as error:
            # gloo's text names only a socket address; the node is what matters.
            logger.debug("reports of rank %d ended: %s", rank, error)
            self.lost.send(
                f"node {self.layout.node_of(rank)} is gone: its rank {rank} "
                f"({self.layout.describe_rank(rank)}) dropped its connection to "
                "rank 0"
            )

    def close(self) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in self.forwarders:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class NodeGone(RuntimeError):
    """Node 0 (rank 0) can no longer be reached: nothing is left to report to."""


class RemoteChannel:
    """A rank on a node other than 0."""

    def __init__(
        self, rank: int, control: GroupCoordinator, report: GroupCoordinator
    ) -> None:
        self.rank, self.control, self.report = rank, control, report
        self.broken = False

    def next_task(self) -> Any:
        try:
            return self.control.broadcast_object(None, src=0)
        except RuntimeError as error:
            self._break(error)

    def put(self, message: tuple) -> None:
        try:
            self.report.send_object(message, dst=0)
        except RuntimeError as error:
            self._break(error)

    def _break(self, error: RuntimeError) -> None:
        self.broken = True
        logger.debug("rank %d lost rank 0: %s", self.rank, error)
        raise NodeGone("lost the connection to rank 0 on node 0") from None

    def close(self) -> None:
        if not self.broken:
            self.put((CLOSED, self.rank))


def rank_channel(
    layout: NodeLayout,
    rank: int,
    tasks: Any,
    results: Any,
    lost: Connection | None,
) -> RankChannel:
    """This rank's channel. Across nodes every rank must call it, in the same
    order after joining the world: creating the relay groups is collective."""
    if not layout.is_multinode:
        return LocalChannel(tasks, results)
    control_ranks = [0, *layout.remote_ranks]
    control = dist.new_group(control_ranks, backend="gloo")
    reports = {}
    for remote in layout.remote_ranks:
        group = dist.new_group([0, remote], backend="gloo")
        if rank in (0, remote):
            reports[remote] = GroupCoordinator(
                [0, remote], rank, group, group, "report"
            )
    if rank in control_ranks:
        control_group = GroupCoordinator(
            control_ranks, rank, control, control, "control"
        )
    if rank == 0:
        return HeadChannel(tasks, results, control_group, reports, layout, lost)
    if rank in layout.remote_ranks:
        return RemoteChannel(rank, control_group, reports[rank])
    return LocalChannel(tasks, results)
