"""The layer plan of a Kimi text stack: what each layer is, derived once from config.

Per 0-based layer: its attention (KDA or MLA), its FFN (dense MLP or MoE), where the
AttnRes blocks close, and whether a DSpark draft taps its output. Model code, the tiny
checkpoint writer and the tests read these facts here instead of re-deriving them.

AttnRes (block size bs): layer l banks the running partial sum before its attention
when l % bs == 0, so its attention mix reads ceil(l / bs) closed blocks and the final
mix after the last layer reads ceil(L / bs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from atom.models.kimi_k3.config_fields import DENSE, KDA, MLA, MOE

EMBEDDING_TAP = -1


class Attention(Enum):
    KDA = KDA
    MLA = MLA


class FFN(Enum):
    DENSE = DENSE
    MOE = MOE


@dataclass(frozen=True)
class LayerPlan:
    index: int
    attention: Attention
    ffn: FFN
    # AttnRes: the layer banks the running block before its attention.
    opens_block: bool
    # AttnRes blocks closed before the layer runs (0 without AttnRes).
    blocks_before: int
    # A draft reads this layer's output (its post-layer residual stream).
    tapped: bool = False

    @property
    def is_kda(self) -> bool:
        return self.attention is Attention.KDA

    @property
    def is_moe(self) -> bool:
        return self.ffn is FFN.MOE


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KimiLayerPlan:
    layers: tuple[LayerPlan, ...]
    attn_res_block_size: int | None
    # The draft's target_layer_ids (-1: the embedding output), empty without a draft.
    taps: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        attention: Sequence[str],
        ffn: Sequence[str],
        attn_res_block_size: int | None,
    ) -> KimiLayerPlan:
        """From per-layer kinds ("kda"/"mla", "dense"/"moe") and the block size."""
        if len(attention) != len(ffn):
            raise ValueError(
                f"{len(attention)} attention kinds for {len(ffn)} FFN kinds"
            )
        bs = attn_res_block_size
        if bs is not None and bs < 1:
            raise ValueError(f"attn_res_block_size must be >= 1, got {bs}")
        layers = tuple(
            LayerPlan(
                index=i,
                attention=Attention(kind),
                ffn=FFN(ffn_kind),
                opens_block=bs is not None and i % bs == 0,
                blocks_before=0 if bs is None else _ceil_div(i, bs),
            )
            for i, (kind, ffn_kind) in enumerate(zip(attention, ffn))
        )
        return cls(layers, bs)

    def with_taps(self, tap_ids: Sequence[int]) -> KimiLayerPlan:
        """This plan with a draft's taps marked (ids as in `target_layer_ids`)."""
        taps = tuple(tap_ids)
        bad = [i for i in taps if not EMBEDDING_TAP <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"tap ids {bad} lie outside {{-1}} and [0, {self.num_layers}) of "
                "this target"
            )
        layers = tuple(replace(layer, tapped=layer.index in taps) for layer in self)
        return replace(self, layers=layers, taps=taps)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, index: int) -> LayerPlan:
        return self.layers[index]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def kda_layers(self) -> frozenset[int]:
        return frozenset(layer.index for layer in self if layer.is_kda)

    @property
    def mla_layers(self) -> frozenset[int]:
        return frozenset(layer.index for layer in self if not layer.is_kda)

    @property
    def moe_layers(self) -> frozenset[int]:
        return frozenset(layer.index for layer in self if layer.is_moe)

    @property
    def block_starts(self) -> tuple[int, ...]:
        """Layers that bank the running block (AttnRes boundaries)."""
        return tuple(layer.index for layer in self if layer.opens_block)

    @property
    def tapped_layers(self) -> tuple[int, ...]:
        """Decoder layers a draft taps (the embedding tap -1 is not a layer)."""
        return tuple(layer.index for layer in self if layer.tapped)

    @property
    def taps_embedding(self) -> bool:
        return EMBEDDING_TAP in self.taps

    def blocks_before(self, layer: int) -> int:
        """Closed AttnRes blocks when `layer` starts; `layer` = L is the final mix."""
        if not 0 <= layer <= self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers}]")
        bs = self.attn_res_block_size
        return 0 if bs is None else _ceil_div(layer, bs)

    @property
    def pattern(self) -> str:
        """Two letters per layer: K/M for KDA/MLA, then d/e for dense/MoE, e.g.
        "Kd Me Ke Me"."""
        return " ".join(
            ("K" if layer.is_kda else "M") + ("e" if layer.is_moe else "d")
            for layer in self
        )
