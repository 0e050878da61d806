"""Stage-to-stage transport of named tensors.

Every key is sent: the header carries the key set, shapes and dtypes, so a payload key
added by a model (the AttnRes block bank, the DSpark taps) can never be dropped by a
whitelist here. The receiver checks the key set against what its model declared.
"""

from __future__ import annotations

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
    device: torch.device, expected_keys: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """Receive from the same TP rank of the previous stage."""
    pp = get_pp_group()
    if pp.is_first_rank:
        raise RuntimeError("the first pipeline stage has no previous stage")
    src = pp.prev_rank
    header = pp.recv_object(src)
    out = {}
    for key, shape, dtype in header:
        out[key] = pp.recv(torch.empty(shape, dtype=dtype, device=device), src)
    # Checked after draining the stream, so the sender is never left mid-message.
    if expected_keys is not None and set(out) != expected_keys:
        raise RuntimeError(
            f"pipeline payload keys {sorted(out)} differ from the declared "
            f"{sorted(expected_keys)}"
        )
    return out
