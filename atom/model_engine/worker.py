"""Rank processes: one per (pp, tp) rank over torch.distributed.

The engine process schedules (it is the head of stage 0) and hands every rank each
batch through that rank's queue; the last stage's TP rank 0 sends back the batch's one
output message. A rank that fails reports its traceback; a rank that dies is noticed by
liveness checks, so the engine raises instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from atom.config import Config
from atom.distributed.parallel_state import (
    destroy_distributed,
    get_pp_group,
    get_tp_group,
    init_distributed,
)
from atom.model_engine.batch import BatchOutput, ScheduledBatch
from atom.model_engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0


@dataclass
class RuntimeInfo:
    """What the engine learns from the ranks at start-up."""

    num_kv_blocks: int
    has_recurrent_state: bool


def rank_device(config: Config, rank: int) -> torch.device:
    device = config.torch_device
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def choose_backend(config: Config) -> str:
    """NCCL when every rank has its own GPU; gloo on CPU or when ranks share a GPU."""
    if config.parallel_config.backend:
        return config.parallel_config.backend
    world = config.parallel_config.world_size
    if config.torch_device.type == "cuda" and world <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def start_runner(config: Config, device: torch.device, num_checkpoints: int):
    """Build this rank's runner and agree on the KV block count (min over ranks)."""
    runner = ModelRunner(config, device)
    blocks = runner.max_kv_blocks(num_checkpoints)
    if dist.is_initialized():
        agreed = torch.tensor([blocks], dtype=torch.long)
        if dist.get_backend() == "nccl":
            agreed = agreed.to(device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        blocks = int(agreed.item())
    runner.allocate_caches(blocks, num_checkpoints)
    return runner, RuntimeInfo(blocks, runner.has_recurrent_state)


def worker_main(
    config: Config,
    rank: int,
    init_method: str,
    backend: str,
    num_checkpoints: int,
    tasks: mp.Queue,
    results: mp.Queue,
) -> None:
    logging.basicConfig(level=os.environ.get("ATOM_LOG_LEVEL", "INFO"))
    try:
        torch.set_num_threads(1)
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        config.parallel_config.rank = rank
        parallel = config.parallel_config
        init_distributed(
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            rank,
            backend,
            init_method,
        )
        runner, info = start_runner(config, device, num_checkpoints)
        reports = get_pp_group().is_last_rank and get_tp_group().is_first_rank
        if rank == 0:
            results.put(("ready", info))
        while (batch := tasks.get()) is not None:
            output = runner.execute(batch)
            if output is not None and reports:
                results.put(("output", output))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        destroy_distributed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """The engine's handle on its rank processes."""

    def __init__(self, config: Config, num_checkpoints: int) -> None:
        ctx = mp.get_context("spawn")
        parallel = config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        backend = choose_backend(config)
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(parallel.world_size)]
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(
                    config,
                    rank,
                    init_method,
                    backend,
                    num_checkpoints,
                    q,
                    self.results,
                ),
                name=f"atom-rank{rank}",
                daemon=True,
            )
            for rank, q in enumerate(self.tasks)
        ]
        for proc in self.procs:
            proc.start()
        kind, info = self._receive(STARTUP_TIMEOUT_S)
        if kind != "ready":
            raise RuntimeError(f"unexpected start-up message {kind!r}")
        self.info: RuntimeInfo = info

    def submit(self, batch: ScheduledBatch) -> None:
        for q in self.tasks:
            q.put(batch)

    def receive_output(self) -> BatchOutput:
        kind, output = self._receive(None)
        if kind != "output":
            raise RuntimeError(f"unexpected message {kind!r} from the last stage")
        return output

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
            if msg[0] == "error":
                self.close()
                _, rank, tb = msg
                raise RuntimeError(f"rank {rank} ({self._where(rank)}) failed:\n{tb}")
            return msg[0], msg[1]

    def _where(self, rank: int) -> str:
        return f"pp_rank {rank // self.tp_size}, tp_rank {rank % self.tp_size}"

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                code = proc.exitcode
                self.close()
                raise RuntimeError(
                    f"rank {rank} ({self._where(rank)}) exited with code {code}; "
                    "the engine cannot continue"
                )

    def close(self) -> None:
        for q, proc in zip(self.tasks, self.procs):
            if proc.is_alive():
                q.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


class InProcessWorker:
    """A single rank run inside the engine process (tp = pp = 1), as nano-vllm does."""

    def __init__(self, config: Config, num_checkpoints: int) -> None:
        self.runner, self.info = start_runner(
            config, rank_device(config, 0), num_checkpoints
        )
        self.outputs: list[BatchOutput] = []

    def submit(self, batch: ScheduledBatch) -> None:
        output = self.runner.execute(batch)
        if output is not None:
            self.outputs.append(output)

    def receive_output(self) -> BatchOutput:
        return self.outputs.pop(0)

    def close(self) -> None:
        self.outputs.clear()
