"""Kimi feed-forward blocks: the dense gated MLP and the (optionally latent) MoE.

Routed experts and the router gate are the shared ones (`model_ops/routed_experts.py`);
partial expert sums are reduced before anything nonlinear touches them.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.distributed.parallel_state import get_tp_group
from atom.model_ops.activation import get_act_and_mul
from atom.model_ops.gated_mlp import GatedMLP
from atom.model_ops.grouped_experts import ExpertChoice
from atom.model_ops.layernorm import RMSNorm
from atom.model_ops.linear import ReplicatedLinear
from atom.model_ops.moe_router import choose_experts
from atom.model_ops.routed_experts import (
    FusedExperts,
    RouterGate,
    expert_block_output,
)
from atom.models.kimi.config import KimiTextConfig


def make_act(config: KimiTextConfig) -> nn.Module:
    return get_act_and_mul(config.hidden_act, config.situ_beta, config.situ_linear_beta)


def dense_mlp(
    config: KimiTextConfig, inner: int, reduce_results: bool = True
) -> GatedMLP:
    """A gated MLP of width `inner` with the config's activation."""
    return GatedMLP(config.hidden_size, inner, make_act(config), reduce_results)


class KimiMoE(nn.Module):
    """Routed experts (optionally in a latent space) plus shared experts."""

    def __init__(self, config: KimiTextConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_token
        self.num_expert_group = config.num_expert_group
        self.topk_group = config.topk_group
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.scoring = config.scoring
        self.gate = RouterGate(hidden, config.num_experts)
        latent = config.routed_expert_hidden_size
        self.latent = latent is not None
        if self.latent:
            self.routed_expert_down_proj = ReplicatedLinear(hidden, latent)
            self.routed_expert_up_proj = ReplicatedLinear(latent, hidden)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, eps=config.rms_norm_eps)
        self.experts = FusedExperts(
            config.num_experts,
            config.moe_intermediate_size,
            latent or hidden,
            make_act(config),
        )
        # Beside plain routed experts the shared ones join the routed partial sum
        # unreduced (`expert_block_output`); a latent MoE adds them after its
        # up-projection, reduced.
        self.shared_experts = (
            dense_mlp(
                config,
                config.moe_intermediate_size * config.num_shared_experts,
                reduce_results=self.latent,
            )
            if config.num_shared_experts
            else None
        )

    def route(self, x: torch.Tensor) -> ExpertChoice:
        """The routed experts of the tokens x [N, H]."""
        return choose_experts(
            self.gate(x),
            self.gate.e_score_correction_bias,
            self.top_k,
            self.num_expert_group,
            self.topk_group,
            self.renormalize,
            self.scaling,
            self.scoring,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.latent:
            return expert_block_output(self.experts, x, self.route, self.shared_experts)
        choice = self.route(x)
        routed_in = self.routed_expert_down_proj(x)
        # Reduce before the norm: RMSNorm of a partial sum is not a partial norm.
        routed = get_tp_group().all_reduce(self.experts(routed_in, choice))
        routed = routed.to(x.dtype)
        if hasattr(self, "routed_expert_norm"):
            routed = self.routed_expert_norm(routed)
        routed = self.routed_expert_up_proj(routed)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed
