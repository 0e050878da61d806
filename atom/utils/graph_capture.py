"""Capturing one CUDA graph, the way every captured forward of the engine does.

Warm-up runs happen on a side stream (so lazy initialisation, autotuning and
allocator growth stay out of the graph), then one run is captured into `pool`, the
memory pool all graphs of one owner share. A capture that fails is reported, not
raised: its owner runs that shape eagerly, and start-up goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)

Output = TypeVar("Output")

WARMUP_RUNS = 2


def capture_graph(
    run: Callable[[], Output], pool: tuple, device: torch.device, what: str
) -> tuple[torch.cuda.CUDAGraph, Output] | None:
    """(graph, static output) of `run`, or None after logging why it failed."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()
        return graph, output
    except Exception as err:  # noqa: BLE001 - any failure means: run it eagerly
        torch.cuda.synchronize(device)
        logger.warning("CUDA graph of %s failed, it runs eagerly: %s", what, err)
        return None
