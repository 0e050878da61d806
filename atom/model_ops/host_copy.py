"""Copies between host and device that never wait for the device's other work."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch


def host_to_device(
    values: list, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Host values as a device tensor. A CUDA copy goes from pinned memory without
    blocking: a plain copy would wait for the forward still running on the stream."""
    return _pinned_copy(torch.tensor(values, dtype=dtype), device)


def pinned(host: torch.Tensor) -> torch.Tensor:
    """A copy of `host` in pinned memory, from the caching host allocator, which
    keeps the block until the copies queued from it have run.

    Not `Tensor.pin_memory()`: that first asks the driver whether `host` is pinned
    already, which took tens of microseconds a call on an H100 host (hundreds for a
    prefill step's buffer); a cached block and a host memcpy take a few."""
    return torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)


def _pinned_copy(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return host
    if host.numel() == 0:  # nothing to copy, nothing to pin
        return host.to(device)
    return pinned(host).to(device, non_blocking=True)


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
        flat = _pinned_copy(torch.tensor(values, dtype=dtype), device)
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
