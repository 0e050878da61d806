"""The layer plan of a Kimi text stack: what each layer is, derived once from config.

Per 0-based layer: its attention (KDA or MLA), its FFN (dense MLP or MoE) and where the
AttnRes blocks close. Model code, the tiny checkpoint writer and the tests read these
facts here instead of re-deriving them.

AttnRes (block size bs): layer l banks the running partial sum before its attention
when l % bs == 0, so its attention mix reads ceil(l / bs) closed blocks and the final
mix after the last layer reads ceil(L / bs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from atom.models.kimi.config_fields import DENSE, KDA, MLA, MOE
from atom.utils.arithmetic import ceil_div


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

    @property
    def is_kda(self) -> bool:
        return self.attention is Attention.KDA

    @property
    def is_moe(self) -> bool:
        return self.ffn is FFN.MOE


@dataclass(frozen=True)
class KimiLayerPlan:
    layers: tuple[LayerPlan, ...]
    attn_res_block_size: int | None

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
                blocks_before=0 if bs is None else ceil_div(i, bs),
            )
            for i, (kind, ffn_kind) in enumerate(zip(attention, ffn))
        )
        return cls(layers, bs)

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

    def blocks_before(self, layer: int) -> int:
        """Closed AttnRes blocks when `layer` starts; `layer` = L is the final mix."""
        if not 0 <= layer <= self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers}]")
        bs = self.attn_res_block_size
        return 0 if bs is None else ceil_div(layer, bs)
