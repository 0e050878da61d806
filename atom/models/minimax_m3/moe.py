"""MiniMax-M3 feed-forward blocks: the dense MLP and the routed + shared MoE.

Every FFN uses the clamped swigluoai activation. The router is fp32 (the checkpoint
ships its gate in fp32): sigmoid scores plus the correction bias choose the top-k
experts, the unbiased scores renormalised to 1 weigh them, and the routed sum is
scaled before the shared expert (no shared gate) is added.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.model_ops.activation import SwigluOAIAndMul
from atom.model_ops.gated_mlp import GatedMLP
from atom.model_ops.grouped_experts import ExpertChoice
from atom.model_ops.moe_router import choose_experts
from atom.model_ops.routed_experts import (
    FusedExperts,
    RouterGate,
    expert_block_output,
)
from atom.models.minimax_m3.config import MiniMaxM3TextConfig


def swigluoai(config: MiniMaxM3TextConfig) -> SwigluOAIAndMul:
    return SwigluOAIAndMul(config.swiglu_alpha, config.swiglu_limit)


def dense_mlp(config: MiniMaxM3TextConfig) -> GatedMLP:
    return GatedMLP(
        config.hidden_size, config.dense_intermediate_size, swigluoai(config)
    )


class MiniMaxM3MoE(nn.Module):
    def __init__(self, config: MiniMaxM3TextConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_token
        self.scaling = config.routed_scaling_factor
        self.gate = RouterGate(hidden, config.num_experts, bias_dtype=torch.float32)
        self.experts = FusedExperts(
            config.num_experts, config.moe_intermediate_size, hidden, swigluoai(config)
        )
        self.shared_experts = None
        if config.shared_intermediate_size:
            self.shared_experts = GatedMLP(
                hidden,
                config.shared_intermediate_size,
                swigluoai(config),
                reduce_results=False,  # reduced with the routed sum
            )

    def route(self, x: torch.Tensor) -> ExpertChoice:
        """The routed experts of the tokens x [N, H]."""
        return choose_experts(
            self.gate(x),
            self.gate.e_score_correction_bias,
            self.top_k,
            renormalize=True,
            routed_scaling_factor=self.scaling,
            scoring="sigmoid",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return expert_block_output(self.experts, x, self.route, self.shared_experts)
