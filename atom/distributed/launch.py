"""Run a function on every rank of a pp x tp world of fresh processes.

Used by multi-process tests and benchmarks: each rank joins a real gloo (or NCCL)
world, runs `fn(rank, *args)`, and its return value comes back to the caller.

A value crosses as bytes written by `torch.save`: a tensor put on a queue as itself
would travel as a shared-memory handle that dies with its rank, and a rank that
exits before the caller reads it would lose the result. For the same reason each
rank stays until the caller has read every result.

Ranks start as the engine's do (rank_process.py): forked by the fork server, with
the caller's environment, ending when the caller is gone.
"""

from __future__ import annotations

import io
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch

from atom.distributed.parallel_state import destroy_distributed, init_distributed
from atom.distributed.rank_process import (
    CallerLink,
    free_port,
    link_to_caller,
    rank_context,
)


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    # Our own ranks wrote these bytes, so arbitrary objects may be unpickled.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _rank_main(
    fn, rank, tp, pp, backend, master_port, link: CallerLink, args, results, all_read
) -> None:
    link.adopt()
    torch.set_num_threads(1)
    try:
        init_distributed(tp, pp, rank, backend, master_port)
        results.put((rank, True, _to_bytes(fn(rank, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()
    # Bounded, so a rank whose caller stopped listening still ends.
    all_read.wait(timeout=600)


def run_ranks(
    fn: Callable[..., Any],
    tp_size: int,
    pp_size: int = 1,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> list[Any]:
    """Results of `fn` ordered by global rank; raises with the first rank's traceback.

    `fn` must be picklable (module level); tensors in its result come back on the CPU.
    """
    ctx = rank_context()
    world = tp_size * pp_size
    results = ctx.Queue()
    all_read = ctx.Event()
    link, lifeline = link_to_caller(ctx)
    master_port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, tp_size, pp_size, backend, master_port, link)
            + (args, results, all_read),
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
            collected[rank] = _from_bytes(value)
    finally:
        all_read.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        lifeline.close()
    return [collected[rank] for rank in range(world)]
