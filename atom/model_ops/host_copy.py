"""Copies between host and device that never wait for the device's other work."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence

import torch


def host_to_device(
    values: list, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Host values as a device tensor. A CUDA copy goes from pinned memory without
    blocking: a plain copy would wait for the forward still running on the stream."""
    return copy_to_device(torch.tensor(values, dtype=dtype), device)


def copy_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`; a CUDA copy is staged in pinned memory
    (`PinnedStaging`) and does not hold the host."""
    if torch.device(device).type == "cpu":
        return host
    if host.numel() == 0:  # nothing to copy, nothing to pin
        return host.to(device)
    on_device = torch.empty(host.shape, dtype=host.dtype, device=device)
    copy_into(on_device, host)
    return on_device


def copy_into(on_device: torch.Tensor, host: torch.Tensor) -> None:
    """Fill `on_device` with CPU tensor `host` (same shape and dtype); a CUDA copy
    is staged in pinned memory and does not hold the host."""
    if on_device.device.type == "cpu":
        on_device.copy_(host)
    else:
        _STAGING.copy(host, on_device)


class PinnedStaging:
    """Page-locked host buffers, pinned once and taken in turn by host-to-device
    copies.

    A copy from pageable memory holds the host until the device has the bytes;
    `Tensor.pin_memory()` does not, but pins a fresh block every call, and a GPU
    decode step makes several such copies while the host is the step's bound. A
    buffer is filled again only after the device has read it: an event recorded
    behind its copy is waited for first, so a non-blocking copy still queued behind
    the running forward never sees its bytes change.
    """

    def __init__(self, depth: int = 8) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0
        # The server's threads and the engine's may copy at once.
        self._lock = threading.Lock()

    def copy(self, host: torch.Tensor, on_device: torch.Tensor) -> None:
        """Copy CPU tensor `host` into CUDA tensor `on_device` (same shape and
        dtype) without waiting for the device."""
        if torch.cuda.is_current_stream_capturing():
            # A captured copy replays from its address for good: not a buffer
            # that is filled again.
            on_device.copy_(host.pin_memory(), non_blocking=True)
            return
        size = host.numel() * host.element_size()
        with self._lock:
            turn = self._next
            self._next = (turn + 1) % len(self._buffers)
            event = self._events[turn]
            if event is None:
                event = self._events[turn] = torch.cuda.Event()
            else:
                event.synchronize()
            buffer = self._buffers[turn]
            if buffer is None or buffer.numel() < size:
                # Grown to twice the need, so a growing batch re-pins rarely.
                buffer = torch.empty(2 * size, dtype=torch.uint8, pin_memory=True)
                self._buffers[turn] = buffer
            staged = buffer[:size].view(host.dtype).view(host.shape)
            staged.copy_(host)
            on_device.copy_(staged, non_blocking=True)
            event.record()


# One per process: page-locked memory serves copies to every device.
_STAGING = PinnedStaging()


def hosts_to_device(
    fields: Sequence[tuple[list, torch.dtype, tuple[int, ...]]],
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Each (flat values, dtype, shape) as a device tensor, in order, with one
    host tensor and one copy per dtype: a step's small host lists cost one
    transfer each otherwise (on a GPU host each costs tens of microseconds of
    launch time), and each `torch.tensor` call about ten."""
    sizes = [math.prod(shape) for _, _, shape in fields]
    for (values, _, shape), size in zip(fields, sizes):
        if len(values) != size:
            raise ValueError(f"{len(values)} values for a tensor of shape {shape}")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, (_, dtype, _) in enumerate(fields):
        by_dtype.setdefault(dtype, []).append(index)
    placed: list[torch.Tensor | None] = [None] * len(fields)
    for dtype, members in by_dtype.items():
        values = list(itertools.chain.from_iterable(fields[i][0] for i in members))
        flat = copy_to_device(torch.tensor(values, dtype=dtype), device)
        for i, part in zip(members, flat.split([sizes[i] for i in members])):
            placed[i] = part.view(fields[i][2])
    return placed


class HostFetch:
    """Device tensors copied to the host without waiting: `get` waits for these
    copies only, not for work queued on the stream after them (async scheduling
    queues the next forward before reading a step's tokens)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event = None
        if all(t.device.type == "cpu" for t in tensors):
            self._host = list(tensors)
            return
        self._host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors
        ]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
