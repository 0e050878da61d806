"""Run a function on every rank of a pp x tp world of fresh processes.

Used by multi-process tests and benchmarks: each rank joins a real gloo (or NCCL)
world, runs `fn(rank, *args)`, and its return value comes back to the caller.

A value crosses as bytes written by `torch.save`: a tensor put on a queue as itself
would travel as a shared-memory handle that dies with its rank, and a rank that
exits before the caller reads it would lose the result. For the same reason each
rank stays until the caller has read every result.

Ranks are forked by multiprocessing's fork server, which imports torch and this
module once, at the first call, and serves every later call of this process: a
spawned rank spent seconds of CPU importing torch again, and on a two-core CI
machine most of a small world's time. A forked rank is not its caller's child and
has the environment of the server's start, so it gets both facts from the call
itself: the caller's environment, and a pipe that tells it the caller is gone.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch

from atom.distributed.parallel_state import destroy_distributed, init_distributed
from atom.distributed.rank_process import die_with_caller, free_port

# Not "__main__", multiprocessing's default: the server would run the caller's main
# script (pytest's, a benchmark's) once more. Importing torch initialises no device,
# so a rank may still take a GPU of its own.
FORK_SERVER_PRELOAD = [__name__]


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    # Our own ranks wrote these bytes, so arbitrary objects may be unpickled.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _rank_main(
    fn, rank, tp, pp, backend, master_port, environ, lifeline, args, results, all_read
) -> None:
    die_with_caller(lifeline)
    os.environ.clear()
    os.environ.update(environ)
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
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)  # read when the server starts
    world = tp_size * pp_size
    results = ctx.Queue()
    all_read = ctx.Event()
    # The ranks get the read end; the write end stays here until they are gone.
    lifeline, lifeline_held = ctx.Pipe(duplex=False)
    master_port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, tp_size, pp_size, backend, master_port, environ)
            + (lifeline, args, results, all_read),
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
        lifeline_held.close()
    return [collected[rank] for rank in range(world)]
