"""Rank processes: one per (pp, tp) rank over torch.distributed.

The engine process schedules (it is the head of stage 0) and hands every rank each
batch through that rank's queue; the last stage's TP rank 0 sends back the batch's one
output message. A rank that fails reports its traceback (one that refuses its settings
at start, only the reason, raised by the engine as ValueError); a rank that dies is
noticed by liveness checks, so the engine raises instead of hanging. A rank never
outlives the process that started it (rank_process.py: how ranks start and end).

Across nodes the engine process holds node 0's ranks only; rank 0 relays every task
to the other nodes' ranks and their messages back (node_relay.py), and a lost node
counts as a dead rank (node_membership.py). Each other node's `atom serve
--headless` starts its own ranks with `start_ranks` (entrypoints/headless.py).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from atom.config import Config
from atom.distributed.dist_interface import use_node_interface
from atom.distributed.node_layout import NodeLayoutError
from atom.distributed.node_membership import NodeMembership
from atom.distributed.node_relay import NodeGone, rank_channel
from atom.distributed.parallel_state import (
    destroy_distributed,
    get_pp_group,
    get_tp_group,
    init_distributed,
)
from atom.distributed.rank_process import (
    CallerLink,
    free_port,
    link_to_caller,
    rank_context,
)
from atom.kv_transfer.rank_calls import attach_kv_connector
from atom.model_engine.batch import BatchOutput, ScheduledBatch
from atom.model_engine.model_runner import LaunchedStep, ModelRunner
from atom.model_loader.model_fingerprint import model_fingerprint
from atom.models.utils import language_model_of
from atom.utils.log_format import configure_logging

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0


@dataclass
class RankReport:
    """One rank's start-up facts: its place, what it loaded, what it holds."""

    pp_rank: int
    tp_rank: int
    # [start, end) of the decoder layers this stage owns.
    layers: tuple[int, int]
    # Parameter bytes by group (`memory_ledger`), as the rank logged them.
    memory_ledger: dict[str, int]
    # Parameters the strict loader accounted for ("target", and "draft" if any).
    loaded_parameters: dict[str, int]


@dataclass
class RuntimeInfo:
    """What the engine learns from the ranks at start-up."""

    num_kv_blocks: int
    has_recurrent_state: bool
    # Every rank's report, in global rank order.
    ranks: list[RankReport] = field(default_factory=list)


def rank_report(runner: ModelRunner) -> RankReport:
    base = language_model_of(runner.model).model
    loaded = {"target": len(runner.load_report.loaded)}
    if runner.drafter is not None:
        loaded["draft"] = len(runner.drafter.load_report.loaded)
    return RankReport(
        get_pp_group().rank_in_group,
        get_tp_group().rank_in_group,
        (base.start_layer, base.end_layer),
        dict(runner.memory_ledger),
        loaded,
    )


def rank_device(config: Config, rank: int) -> torch.device:
    device = config.torch_device
    if device.type == "cuda":
        local = rank % config.node_layout.local_ranks
        return torch.device("cuda", local % torch.cuda.device_count())
    return device


def choose_backend(config: Config) -> str:
    """NCCL when every rank of a node has its own GPU; gloo on CPU or when ranks
    share a GPU."""
    local = config.node_layout.local_ranks
    if config.torch_device.type == "cuda" and local <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def start_runner(config: Config, device: torch.device):
    """Build this rank's runner and agree on the KV block count (min over ranks)."""
    runner = ModelRunner(config, device)
    blocks = runner.max_kv_blocks()
    if dist.is_initialized():
        agreed = torch.tensor([blocks], dtype=torch.long)
        if dist.get_backend() == "nccl":
            agreed = agreed.to(device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        blocks = int(agreed.item())
    runner.allocate_caches(blocks)
    if config.kv_transfer is not None:
        attach_kv_connector(runner)
    reports = [rank_report(runner)]
    if dist.is_initialized():
        # Small objects over the world group, so rank 0's ready message covers all.
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, rank_report(runner))
    return runner, RuntimeInfo(blocks, runner.has_recurrent_state, reports)


def worker_main(
    config: Config,
    rank: int,
    master_port: int,
    backend: str,
    link: CallerLink,
    tasks: mp.Queue | None,
    results: mp.Queue | None,
    lost: Connection | None = None,
) -> None:
    """One rank. On a node other than 0 `tasks` and `results` are None: the rank
    talks to node 0 through its channel (node_relay.py)."""
    link.adopt()
    # Ctrl-C in a terminal reaches every process of its group; the engine process
    # ends its ranks itself (close()), so a rank must not stop mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()
    channel = None
    try:
        torch.set_num_threads(1)
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        layout = config.node_layout
        init_distributed(
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            rank,
            backend,
            master_port,
            layout,
        )
        channel = rank_channel(layout, rank, tasks, results, lost)
        try:
            runner, info = start_runner(config, device)
        except ValueError as error:
            # Settings this rank cannot run (say, drafts that leave no room for
            # the cache): the user's to change, so the engine raises the message
            # as a ValueError, as it does when it runs the only rank itself.
            channel.put(("refused", rank, str(error)))
            return
        reports = get_pp_group().is_last_rank and get_tp_group().is_first_rank
        if rank == 0:
            channel.put(("ready", info))
        while (task := channel.next_task()) is not None:
            if callable(task):
                channel.put(("call", rank, task(runner)))
                continue
            launched = runner.execute(task)
            if launched is not None:
                output = runner.finish(launched)
                if reports:
                    channel.put(("output", output))
    except NodeGone as gone:  # its node's supervisor says why the node ends
        logger.error("rank %d stops: %s", rank, gone)
        raise SystemExit(1) from None
    except BaseException:
        failure = ("error", rank, traceback.format_exc())
        if channel is not None:
            channel.put(failure)
        elif results is not None:
            results.put(failure)
        else:  # no way to node 0 yet: the node's log, and the exit code, tell
            logger.error("rank %d failed:\n%s", rank, failure[2])
            raise SystemExit(1) from None
    finally:
        if channel is not None:
            channel.close()
        destroy_distributed()


# Rank processes are named RANK_PROCESS_PREFIX + rank. multiprocessing re-imports the
# user's main script in each of them under that name, so an engine started there
# comes from a script without the `__main__` guard: such a rank exits with
# UNGUARDED_MAIN_EXIT and no output, and the parent says why once.
RANK_PROCESS_PREFIX = "atom-rank"
UNGUARDED_MAIN_EXIT = 3
UNGUARDED_MAIN = (
    "the script that starts this engine runs it at import, and atom starts each "
    "rank process by importing that script again (multiprocessing): put the "
    'code that builds the engine under `if __name__ == "__main__":`'
)


def refuse_engine_in_rank_process() -> None:
    """Stop a rank process that is re-importing an unguarded main script."""
    name = mp.current_process().name
    if (
        name.startswith(RANK_PROCESS_PREFIX)
        and name[len(RANK_PROCESS_PREFIX) :].isdigit()
    ):
        # Not SystemExit: a child of the fork server that raises it while it starts
        # exits with 1, and the parent could not tell why.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(UNGUARDED_MAIN_EXIT)


def start_ranks(
    config: Config,
    tasks: list[mp.Queue] | None,
    results: mp.Queue | None,
    lost: Connection | None = None,
) -> tuple[list[mp.Process], Connection]:
    """Start this node's rank processes (`tasks`: one queue each on node 0). With
    them comes the write end of their lifeline (`link_to_caller`): the caller keeps
    it open while they may run, and closes it after they ended."""
    ctx = rank_context()
    link, lifeline = link_to_caller(ctx)
    backend = choose_backend(config)
    ranks = config.node_layout.my_ranks
    # The loopback store's port on one machine (across nodes, node 0's is used).
    master_port = free_port()
    procs = [
        ctx.Process(
            target=worker_main,
            args=(
                config,
                rank,
                master_port,
                backend,
                link,
                None if tasks is None else tasks[i],
                results,
                lost if rank == 0 else None,
            ),
            name=f"{RANK_PROCESS_PREFIX}{rank}",
            daemon=True,
        )
        for i, rank in enumerate(ranks)
    ]
    for proc in procs:
        proc.start()
    return procs, lifeline


class WorkerGroup:
    """The engine's handle on its rank processes (across nodes: those of node 0,
    the rendezvous with the other nodes, and the watch on them)."""

    def __init__(self, config: Config) -> None:
        ctx = rank_context()
        self.layout = layout = config.node_layout
        self.nodes: NodeMembership | None = None
        self._lost_lock = threading.Lock()
        # Rank 0 names a lost node on this pipe; the parent keeps the writer open
        # too, so the reader never sees EOF.
        self._lost: Connection | None = None
        self._lost_writer: Connection | None = None
        if layout.node_rank != 0:
            raise NodeLayoutError(
                f"the engine runs on node 0; start node {layout.node_rank} with "
                "`atom serve --headless` and the same flags"
            )
        if layout.is_multinode:
            use_node_interface(layout)
            self.nodes = NodeMembership(
                config, choose_backend(config), model_fingerprint(config)
            )
            self._lost, self._lost_writer = ctx.Pipe(duplex=False)
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in layout.my_ranks]
        self.procs, self._lifeline = start_ranks(
            config, self.tasks, self.results, self._lost_writer
        )
        kind, info = self._receive(STARTUP_TIMEOUT_S)
        if kind != "ready":
            raise RuntimeError(f"unexpected start-up message {kind!r}")
        self.info: RuntimeInfo = info

    def submit(self, batch: ScheduledBatch) -> None:
        for q in self.tasks:
            q.put(batch)

    def receive_output(self) -> BatchOutput:
        kind, *body = self._receive(None)
        if kind != "output":
            raise RuntimeError(f"unexpected message {kind!r} from the last stage")
        return body[0]

    def call(self, fn: Callable[[ModelRunner], Any]) -> list[Any]:
        """`fn(runner)` on every rank, results in global rank order (inspection and
        tests; only while no batch is in flight). `fn` must pickle (module level);
        return plain data or numpy, since tensors would travel as shared memory
        that dies with the rank."""
        for q in self.tasks:
            q.put(fn)
        replies: dict[int, Any] = {}
        world = self.layout.world_size
        while len(replies) < world:
            kind, *body = self._receive(None)
            if kind != "call":
                raise RuntimeError(f"unexpected message {kind!r} during call")
            rank, value = body
            replies[rank] = value
        return [replies[rank] for rank in range(world)]

    def _receive(self, timeout: float | None) -> tuple:
        waited = 0.0
        while True:
            try:
                msg = self.results.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                waited += 0.5
                if timeout is not None and waited > timeout:
                    self.close()
                    raise TimeoutError(
                        f"ranks sent nothing for {timeout:.0f} s"
                    ) from None
                continue
            if msg[0] == "refused":
                _, rank, reason = msg
                self.close()
                raise ValueError(
                    f"rank {rank} ({self.layout.describe_rank(rank)}): {reason}"
                )
            if msg[0] == "error":
                _, rank, tb = msg
                failed = (
                    f"rank {rank} ({self.layout.describe_rank(rank)}) failed:\n{tb}"
                )
                # A killed rank breaks its peers' send/recv first: name the cause.
                crashed = self._crashed_rank() or self._node_loss()
                self.close()
                if crashed is not None:
                    raise RuntimeError(f"{crashed}; then {failed}")
                raise RuntimeError(failed)
            return msg

    def _exited_rank(self, crashed_only: bool = False) -> str | None:
        """The first rank that is gone, or None; `crashed_only` skips ranks that
        returned (code 0), as a rank does after reporting its own error."""
        for rank, proc in zip(self.layout.my_ranks, self.procs):
            if proc.is_alive() or (crashed_only and proc.exitcode == 0):
                continue
            where = self.layout.describe_rank(rank)
            if proc.exitcode == UNGUARDED_MAIN_EXIT:
                return f"rank {rank} ({where}) stopped at start: {UNGUARDED_MAIN}"
            return f"rank {rank} ({where}) exited with code {proc.exitcode}"
        return None

    def _node_loss(self) -> str | None:
        """Why another node is gone (its ranks' sockets broke, it failed, its
        heartbeat stopped), or None; safe from the engine and the monitor."""
        if self.nodes is None:
            return None
        with self._lost_lock:
            while self._lost.poll():
                self.nodes.note_lost(self._lost.recv())
        return self.nodes.lost()

    def _crashed_rank(self, grace_s: float = 0.5) -> str | None:
        # The peer's socket closes a moment before its process can be reaped.
        deadline = time.monotonic() + grace_s
        while (crashed := self._exited_rank(crashed_only=True)) is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return crashed

    def _check_alive(self) -> None:
        exited = self._exited_rank() or self._node_loss()
        if exited is not None:
            self.close()
            # Called while waiting on the results queue: its Empty is no cause.
            raise RuntimeError(f"{exited}; the engine cannot continue") from None

    def wait_for_rank_exit(self, timeout: float) -> str | None:
        """Block up to `timeout` s until a rank process ends or another node is
        lost; say which and how.

        Safe from another thread than the engine's: it only watches the process
        sentinels and the other nodes, so a death while the engine idles is seen
        at once.
        """
        waitables = [proc.sentinel for proc in self.procs]
        ended = connection.wait(
            waitables + ([self._lost] if self._lost else []), timeout
        )
        exited = [proc for proc in self.procs if proc.sentinel in ended]
        for proc in exited:
            proc.join(timeout=1.0)  # reaped, so its exit code is known
        if exited:
            return self._exited_rank() or "a rank process exited"
        return self._node_loss()

    def close(self) -> None:
        for q, proc in zip(self.tasks, self.procs):
            if proc.is_alive():
                q.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._lifeline.close()
        if self.nodes is not None:
            self.nodes.close()


class InProcessWorker:
    """A single rank run inside the engine process (tp = pp = 1), as nano-vllm does."""

    def __init__(self, config: Config) -> None:
        device = rank_device(config, 0)
        if device.type == "cpu":
            # Like the rank processes: the ops of a CPU-served model are small, and
            # OpenMP threads spinning on them cost far more than they parallelise.
            torch.set_num_threads(1)
        self.runner, self.info = start_runner(config, device)
        # Launched steps, oldest first; finishing one waits for its tokens only.
        self.launched: deque[LaunchedStep] = deque()

    def submit(self, batch: ScheduledBatch) -> None:
        launched = self.runner.execute(batch)
        if launched is not None:
            self.launched.append(launched)

    def receive_output(self) -> BatchOutput:
        return self.runner.finish(self.launched.popleft())

    def call(self, fn: Callable[[ModelRunner], Any]) -> list[Any]:
        return [fn(self.runner)]

    def close(self) -> None:
        """Give back what the runner took on the device (weights, caches, graph
        pools), so another engine in this process has the memory."""
        self.launched.clear()
        if self.runner is None:
            return
        device = self.runner.device
        self.runner = None
        gc.collect()  # the drafter's hooks on the target form reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
