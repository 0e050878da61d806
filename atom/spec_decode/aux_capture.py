"""Capture of the target's tap hidden states for the DSpark draft.

Tap id k >= 0 is the output of decoder layer k as that layer defines it
(`layer.aux_hidden_state(output)`, the post-layer residual stream); -1 is the
embedding output. Forward hooks copy each target forward's rows into the first rows
of a preallocated [max_num_tokens, H] buffer. They re-read `is_draft` on every call and write nothing during
draft forwards: the draft embeds its block with the shared target embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.models.interfaces import TapLayer
from atom.models.utils import PPMissingLayer
from atom.utils.forward_context import get_forward_context

EMBEDDING_TAP = -1


def allocate_tap_buffers(
    count: int,
    max_num_tokens: int,
    hidden_size: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    return [
        torch.zeros(max_num_tokens, hidden_size, device=device, dtype=dtype)
        for _ in range(count)
    ]


def tap_module(target_model: nn.Module, layer_id: int) -> nn.Module:
    """The module whose forward produces tap `layer_id` on this stage."""
    module = (
        target_model.embed_tokens
        if layer_id == EMBEDDING_TAP
        else target_model.layers[layer_id]
    )
    if isinstance(module, PPMissingLayer):
        raise TypeError(
            f"tap {layer_id} is not resident here: its module is a PPMissingLayer "
            "(only resident taps may be hooked; others arrive through the relay)"
        )
    if layer_id != EMBEDDING_TAP and not isinstance(module, TapLayer):
        raise TypeError(
            f"decoder layer {layer_id} ({type(module).__name__}) has no "
            "aux_hidden_state(output); it cannot serve as a DSpark tap"
        )
    return module


def _record(buffer: torch.Tensor, rows: torch.Tensor, layer_id: int) -> None:
    if get_forward_context().is_draft:
        return
    rows = rows.reshape(-1, rows.shape[-1])
    if rows.shape[-1] != buffer.shape[-1]:
        raise ValueError(
            f"tap {layer_id} rows are {rows.shape[-1]} wide, its buffer "
            f"{buffer.shape[-1]}"
        )
    if rows.shape[0] > buffer.shape[0]:
        raise RuntimeError(
            f"tap {layer_id}: {rows.shape[0]} rows exceed its buffer of "
            f"{buffer.shape[0]} rows (max_num_batched_tokens)"
        )
    buffer[: rows.shape[0]].copy_(rows)


class TapCapture:
    """Forward hooks writing resident taps into `buffers` (layer id -> buffer)."""

    def __init__(self, target_model: nn.Module, buffers: dict[int, torch.Tensor]):
        self.layer_ids = sorted(buffers)
        self.handles = []
        for layer_id in self.layer_ids:
            module = tap_module(target_model, layer_id)
            self.handles.append(
                module.register_forward_hook(self._hook(layer_id, buffers[layer_id]))
            )

    @staticmethod
    def _hook(layer_id: int, buffer: torch.Tensor):
        if layer_id == EMBEDDING_TAP:

            def on_embedding(module, args, output):
                _record(buffer, output, layer_id)

            return on_embedding

        def on_layer(module, args, output):
            _record(buffer, module.aux_hidden_state(output), layer_id)

        return on_layer

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
