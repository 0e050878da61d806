"""Work that runs beside the current CUDA stream and joins it where its result is read.

At a small decode batch a MoE layer's routed path is a chain of latency-bound
kernels (the router's product, the top-k choice, the sort by expert, the tile list)
that leave the memory system idle for microseconds at a time, while the shared
experts' two products read their weights and depend on none of it. Launched on a
second stream before the router (`routed_experts.expert_block_output`), the shared
experts run under that chain and the routed products; inside a CUDA graph capture
the fork and the join become the graph's edges, so every replay overlaps them.

The side stream is one per device, made on first use. It is used on every CUDA
forward, eager ones included, so the graph captures' warm-up runs (eager, before
each capture) initialise what it needs (cuBLAS's handle and workspace for it)
outside the capture. On the CPU the work runs inline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(index)
    return _streams[index]


class Pending:
    """A tensor queued on a side stream; `wait` orders the current stream after the
    work that makes it (an event recorded right after that work, so work queued on
    the side stream later is not waited for) and returns it, at once where it was
    made inline."""

    def __init__(self, value: torch.Tensor, made: torch.cuda.Event | None) -> None:
        self._value = value
        self._made = made

    def wait(self) -> torch.Tensor:
        if self._made is not None:
            torch.cuda.current_stream(self._value.device).wait_event(self._made)
            self._made = None
        return self._value


def run_beside(work: Callable[[], torch.Tensor], device: torch.device) -> Pending:
    """Run `work` on `device`'s side stream after everything queued so far on the
    current stream; read its result through `Pending.wait`, before the tensors
    `work` reads go out of scope. Every result must be waited for (a graph capture
    fails on an unjoined fork). `work` must not communicate (no collectives): only
    the current stream orders those.

    No `record_stream` is needed: the caller holds `work`'s inputs until the join,
    so the current stream reuses none of their memory while the side stream reads
    it; and the side stream reuses the result's memory only in a later `work`,
    which starts after the current stream's reads queued before that fork."""
    if device.type != "cuda":
        return Pending(work(), None)
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        value = work()
        made = torch.cuda.Event()
        made.record(side)
    return Pending(value, made)


def joined(value: torch.Tensor | Pending | None) -> torch.Tensor | None:
    """`value`, joined into the current stream where it is still pending."""
    return value.wait() if isinstance(value, Pending) else value
