"""Relay of DSpark tap hidden states across pipeline stages (docs/pp_dspark.md).

The drafter lives on the last stage, but its taps span the whole stack. Each stage
derives, from its own layer placement alone, which taps it owns, which arrive from
earlier stages and which it sends on; no metadata travels. A non-last stage hooks
its own taps and sends [received | own] as one tensor under `aux_hidden_states`;
the last stage unpacks the received column blocks by tap and hands them to the
drafter. Residency is structural (`tap_is_resident`), the one rule the drafter's
capture and the relay share: the embedding copy the last stage holds for its
drafter never runs in the target forward, so it must never count as tap -1.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.models.utils import PPMissingLayer
from atom.spec_decode.aux_capture import (
    EMBEDDING_TAP,
    TapCapture,
    allocate_tap_buffers,
)

AUX_KEY = "aux_hidden_states"


def decoder_layers(target_model: nn.Module) -> nn.ModuleList:
    layers = getattr(target_model, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(target_model).__name__} has no .layers; pass the target's base "
            "model (language_model_of(model).model)"
        )
    return layers


def tap_is_resident(target_model: nn.Module, layer_id: int) -> bool:
    """Does this stage compute tap `layer_id` in its target forward?

    k >= 0: layers[k] is real here. -1: layers[0] is real here (the stage that runs
    the embedding for the target). Whether an embedding module exists is never
    asked: the last stage may hold one that only the draft calls.
    """
    layers = decoder_layers(target_model)
    if layer_id == EMBEDDING_TAP:
        return not isinstance(layers[0], PPMissingLayer)
    if not 0 <= layer_id < len(layers):
        raise ValueError(
            f"tap id {layer_id} lies outside {{-1}} and [0, {len(layers)})"
        )
    return not isinstance(layers[layer_id], PPMissingLayer)


def stage_layer_range(target_model: nn.Module) -> tuple[int, int]:
    """[start, end) of the real decoder layers on this stage."""
    real = [
        i
        for i, layer in enumerate(decoder_layers(target_model))
        if not isinstance(layer, PPMissingLayer)
    ]
    if not real:
        raise ValueError("this stage holds no decoder layers")
    return real[0], real[-1] + 1


class PPAuxRelay:
    """One stage's part of the tap relay.

    own: resident taps. incoming: non-own taps with id < start (so -1 on every
    non-first stage). outgoing: incoming then own on non-last stages, nothing on the
    last. Invariant: incoming(s + 1) == outgoing(s).
    """

    def __init__(
        self,
        target_model: nn.Module,
        tap_ids: list[int],
        hidden_size: int,
        max_num_tokens: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tap_ids = list(tap_ids)
        if any(b <= a for a, b in zip(tap_ids, tap_ids[1:])):
            raise ValueError(f"tap ids {tap_ids} must be strictly increasing")
        layers = decoder_layers(target_model)
        self.tap_ids = tap_ids
        self.hidden_size = hidden_size
        self.start, self.end = stage_layer_range(target_model)
        self.is_first = not isinstance(layers[0], PPMissingLayer)
        self.is_last = not isinstance(layers[-1], PPMissingLayer)
        self.own = [t for t in tap_ids if tap_is_resident(target_model, t)]
        self.incoming = [t for t in tap_ids if t not in self.own and t < self.start]
        self.outgoing = [] if self.is_last else self.incoming + self.own
        self.buffers: dict[int, torch.Tensor] = {}
        self.capture: TapCapture | None = None
        if not self.is_last and self.own:
            buffers = allocate_tap_buffers(
                len(self.own), max_num_tokens, hidden_size, device, dtype
            )
            self.buffers = dict(zip(self.own, buffers))
            self.capture = TapCapture(target_model, self.buffers)

    @property
    def arms_taps(self) -> bool:
        """Whether this stage hooks taps of its own for the next stage."""
        return self.capture is not None

    def describe(self) -> str:
        return (
            f"layers {self.start}:{self.end}, capturing taps {self.own}, receiving "
            f"{self.incoming}, sending {self.outgoing}"
        )

    def _check_received(self, received: torch.Tensor | None, num_tokens: int) -> None:
        if not self.incoming:
            if received is not None:
                raise ValueError(
                    f"stage with layers {self.start}:{self.end} expects no relayed "
                    f"taps but received a block of shape {tuple(received.shape)}"
                )
            return
        if received is None:
            raise RuntimeError(
                f"missing '{AUX_KEY}' block: stage with layers {self.start}:"
                f"{self.end} expects taps {self.incoming} from earlier stages"
            )
        width = len(self.incoming) * self.hidden_size
        if received.dim() != 2 or received.shape[1] != width:
            raise ValueError(
                f"'{AUX_KEY}' block has shape {tuple(received.shape)}; expected "
                f"[N, {width}] for taps {self.incoming} of width {self.hidden_size}"
            )
        if received.shape[0] < num_tokens:
            raise ValueError(
                f"'{AUX_KEY}' block has {received.shape[0]} rows, the forward "
                f"{num_tokens}"
            )

    def pack(
        self, received: torch.Tensor | None, num_tokens: int
    ) -> torch.Tensor | None:
        """[N, |outgoing| * H]: the received block, then this stage's own taps.

        None when nothing goes out (a stage before which and on which no tap lives).
        """
        if self.is_last:
            raise RuntimeError("the last stage sends no taps; call unpack instead")
        self._check_received(received, num_tokens)
        if not self.outgoing:
            return None
        parts = [] if received is None else [received[:num_tokens]]
        parts += [self.buffers[t][:num_tokens] for t in self.own]
        return torch.cat(parts, dim=-1)

    def unpack(
        self, received: torch.Tensor | None, num_tokens: int
    ) -> dict[int, torch.Tensor]:
        """Last stage: tap id -> its [N, H] rows, views of the received block."""
        if not self.is_last:
            raise RuntimeError("only the last stage unpacks relayed taps")
        self._check_received(received, num_tokens)
        width = self.hidden_size
        return {
            tap: received[:num_tokens, column * width : (column + 1) * width]
            for column, tap in enumerate(self.incoming)
        }

    def remove(self) -> None:
        if self.capture is not None:
            self.capture.remove()
