"""Stage-to-stage transport of named tensors.

Every key is sent: the header carries the key set, shapes and dtypes, so a payload key
added by a model (the AttnRes block bank, the DSpark taps) can never be dropped by a
whitelist here. The receiver checks the key set against what its model declared.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from atom.distributed.parallel_state import get_pp_group


def send_tensor_dict(tensors: dict[str, torch.Tensor]) -> None:
    """Send to the same TP rank of the next stage."""
    pp = get_pp_group()
    if pp.is_last_rank:
        raise RuntimeError("the last pipeline stage has no next stage to send to")
    dst = pp.next_rank
    header = [(key, tuple(t.shape), t.dtype) for key, t in tensors.items()]
    pp.send_object(header, dst)
    for _, tensor in tensors.items():
        pp.send(tensor, dst)


def recv_tensor_dict(
    device: torch.device,
    expected_keys: set[str] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Receive from the same TP rank of the previous stage.

    `into` holds persistent buffers (a captured graph's static payload): a key
    whose dtype and row shape match its buffer, and whose rows fit, arrives in the
    buffer's leading rows, with no allocation and no copy into the graph's input.
    """
    pp = get_pp_group()
    if pp.is_first_rank:
        raise RuntimeError("the first pipeline stage has no previous stage")
    src = pp.prev_rank
    header = pp.recv_object(src)
    out = {}
    for key, shape, dtype in header:
        out[key] = pp.recv(_landing(key, shape, dtype, device, into), src)
    # Checked after draining the stream, so the sender is never left mid-message.
    if expected_keys is not None and set(out) != expected_keys:
        raise RuntimeError(
            f"pipeline payload keys {sorted(out)} differ from the declared "
            f"{sorted(expected_keys)}"
        )
    return out


def _landing(
    key: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    into: Mapping[str, torch.Tensor] | None,
) -> torch.Tensor:
    """Where one received tensor goes: its buffer's leading rows, or a new one."""
    buffer = None if into is None else into.get(key)
    if (
        buffer is not None
        and buffer.dtype == dtype
        and shape
        and tuple(buffer.shape[1:]) == tuple(shape[1:])
        and shape[0] <= buffer.shape[0]
    ):
        return buffer[: shape[0]]
    return torch.empty(shape, dtype=dtype, device=device)
