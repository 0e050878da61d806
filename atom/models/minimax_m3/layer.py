"""One MiniMax-M3 decoder layer: GemmaNorm pre-norm attention, then a dense MLP or
the MoE.

Layers pass `(hidden_states, residual)` along: `hidden_states` is the previous
layer's FFN output, not yet added, and `residual` the stream before that add. The
layer adds it first, so a pipeline stage (or a DSpark tap) folds it in exactly once.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.layernorm import GemmaRMSNorm, pre_norm_attention
from atom.models.minimax_m3.attention import MiniMaxM3Attention
from atom.models.minimax_m3.config import MiniMaxM3TextConfig
from atom.models.minimax_m3.moe import MiniMaxM3MoE, dense_mlp

LayerOutput = tuple[torch.Tensor, torch.Tensor]


class MiniMaxM3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: MiniMaxM3TextConfig,
        layer_idx: int,
        prefix: str = "",
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps=eps)
        self.self_attn = MiniMaxM3Attention(
            config, layer_idx, f"{prefix}.self_attn", attention_backend
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps=eps)
        if config.layers[layer_idx].moe:
            self.block_sparse_moe = MiniMaxM3MoE(config)
        else:
            self.mlp = dense_mlp(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> LayerOutput:
        z, stream = pre_norm_attention(
            self.input_layernorm,
            self.post_attention_layernorm,
            self.self_attn,
            positions,
            hidden_states,
            residual,
        )
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return ffn(z), stream

    def aux_hidden_state(self, output: LayerOutput) -> torch.Tensor:
        """The DSpark tap of this layer: the residual stream after it (the
        reference's hidden_states[l + 1]), TP-reduced like every layer output."""
        ffn_out, residual = output
        return residual + ffn_out
