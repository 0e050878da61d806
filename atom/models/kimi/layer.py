"""One Kimi decoder layer: KDA or MLA, then a dense MLP or MoE (docs/kimi_k3.md).

Layers pass `(hidden_states, residual, block_residual)` along. `hidden_states` is the
previous layer's FFN output, not yet added: the layer adds it first, so a pipeline
stage (or a DSpark tap) can fold it in exactly once.

- Plain residual: `residual` is the stream before that add.
- AttnRes: `residual` is the current block's partial sum p, and `block_residual` the
  bank B [N, nB, H] of closed blocks; banking happens after the attention-site mix.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.attn_res import attn_res_mix_norm
from atom.model_ops.layernorm import RMSNorm, pre_norm_attention
from atom.model_ops.linear import ReplicatedLinear
from atom.models.kimi.config import KimiTextConfig
from atom.models.kimi.kda import KimiDeltaAttention
from atom.models.kimi.mla import KimiMLAttention
from atom.models.kimi.moe import KimiMoE, dense_mlp

LayerOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class KimiDecoderLayer(nn.Module):
    def __init__(
        self,
        config: KimiTextConfig,
        layer_idx: int,
        prefix: str = "",
        kda_backend: str = "auto",
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if config.is_kda_layer(layer_idx):
            self.self_attn = KimiDeltaAttention(
                config, f"{prefix}.self_attn", kda_backend
            )
        else:
            self.self_attn = KimiMLAttention(
                config, f"{prefix}.self_attn", attention_backend
            )
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = KimiMoE(config)
        else:
            self.mlp = dense_mlp(config, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.eps = eps
        self.block_size = config.attn_res_block_size
        self.opens_block = config.plan[layer_idx].opens_block
        if self.block_size is not None:
            self.self_attention_res_norm = RMSNorm(hidden, eps=eps)
            self.self_attention_res_proj = ReplicatedLinear(hidden, 1)
            self.mlp_res_norm = RMSNorm(hidden, eps=eps)
            self.mlp_res_proj = ReplicatedLinear(hidden, 1)

    def _mix_norm(
        self,
        norm: RMSNorm,
        proj: ReplicatedLinear,
        bank: torch.Tensor,
        p: torch.Tensor,
        then: RMSNorm,
    ) -> torch.Tensor:
        """then(AttnRes mix of bank and p, scored through norm and proj)."""
        return attn_res_mix_norm(bank, p, norm.weight, proj.weight, self.eps, then)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x)
        return self.mlp(x)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        block_residual: torch.Tensor | None = None,
    ) -> LayerOutput:
        if self.block_size is None:
            z, stream = pre_norm_attention(
                self.input_layernorm,
                self.post_attention_layernorm,
                self.self_attn,
                positions,
                hidden_states,
                residual,
            )
            return self._ffn(z), stream, None
        stream = hidden_states if residual is None else residual + hidden_states
        if block_residual is None:
            raise ValueError(
                f"AttnRes layer {self.layer_idx} needs block_residual (the bank)"
            )
        bank = block_residual
        x = self._mix_norm(
            self.self_attention_res_norm,
            self.self_attention_res_proj,
            bank,
            stream,
            self.input_layernorm,
        )
        partial: torch.Tensor | None = stream
        if self.opens_block:
            bank = torch.cat([bank, stream.unsqueeze(1)], dim=1)
            partial = None
        attn_out = self.self_attn(positions, x)
        partial = attn_out if partial is None else partial + attn_out
        z = self._mix_norm(
            self.mlp_res_norm,
            self.mlp_res_proj,
            bank,
            partial,
            self.post_attention_layernorm,
        )
        return self._ffn(z), partial, bank

    def aux_hidden_state(self, output: LayerOutput) -> torch.Tensor:
        """The DSpark tap of this layer from its forward output: p_out (AttnRes) or
        the residual stream after the layer, i.e. the reference hidden_states[l+1]."""
        ffn_out, residual, _ = output
        return residual + ffn_out
