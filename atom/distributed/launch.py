"""Run a function on every rank of a pp x tp world of fresh processes.

Used by multi-process tests and benchmarks: each rank joins a real gloo (or NCCL)
world, runs `fn(rank, *args)`, and its return value comes back to the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

from atom.distributed.parallel_state import destroy_distributed, init_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, tp, pp, backend, init_method, args, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        init_distributed(tp, pp, rank, backend, init_method)
        results.put((rank, True, fn(rank, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


def run_ranks(
    fn: Callable[..., Any],
    tp_size: int,
    pp_size: int = 1,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Results of `fn` ordered by global rank; raises with the first rank's traceback."""
    ctx = mp.get_context("spawn")
    world = tp_size * pp_size
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, tp_size, pp_size, backend, init_method, args, results),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    try:
        while len(collected) < world:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(collected))} "
                    f"returned nothing in {timeout_s:.0f} s"
                ) from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    return [collected[rank] for rank in range(world)]
