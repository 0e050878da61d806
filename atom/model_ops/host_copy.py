"""Host lists to device tensors without waiting for the device."""

from __future__ import annotations

import torch


def host_to_device(
    values: list, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Host values as a device tensor. A CUDA copy goes from pinned memory without
    blocking: a plain copy would wait for the forward still running on the stream."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    if host.numel() == 0:  # nothing to copy, nothing to pin
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
