"""The Kimi Linear / K3 text config, normalised and validated.

Reading follows transformers' `KimiLinearConfig` field by field, and the K3
`text_config` dialect goes through the same reader (config_fields.py); the per-layer
schedule becomes a `KimiLayerPlan` (plan.py). Every model module reads this one
normalised view, so neither spelling quirks nor 1-based layer lists leak into layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from atom.models.kimi.config_fields import (
    TRANSFORMERS_MLA_NORM_EPS,
    attention_schedule,
    decodes_as_transformers,
    ffn_schedule,
    linear_attn_config,
    read_fields,
)
from atom.models.kimi.plan import KimiLayerPlan

GATE_LOWER_BOUND_RANGE = (-5.0, 0.0)


@dataclass(frozen=True)
class KimiTextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    mla_norm_eps: float
    # KDA
    kda_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float | None
    use_full_rank_gate: bool
    # FFN
    hidden_act: str
    situ_beta: float | None
    situ_linear_beta: float | None
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    scoring: str
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    # Per layer: attention and FFN kind, AttnRes blocks (None: plain residual).
    plan: KimiLayerPlan

    @classmethod
    def from_hf(cls, text: Mapping[str, Any], tp_size: int = 1) -> KimiTextConfig:
        """Normalise a text config: a flat Kimi Linear config (as transformers or
        the checkpoint writes it) or a K3 `text_config`."""
        f = read_fields(text)
        num_layers = int(f["num_hidden_layers"])
        lac = linear_attn_config(text)
        _refuse_unsupported(text, f)
        block_size = f.get("attn_res_block_size") or None  # 0 also means "off"
        plan = KimiLayerPlan.build(
            attention_schedule(text, num_layers),
            ffn_schedule(text, num_layers),
            block_size,
        )
        grouped = f.get("use_grouped_topk", True)
        eps = float(f["rms_norm_eps"])
        if f.get("mla_norm_eps") is not None:
            mla_norm_eps = float(f["mla_norm_eps"])
        elif decodes_as_transformers(text):
            mla_norm_eps = TRANSFORMERS_MLA_NORM_EPS
        else:
            mla_norm_eps = eps  # vLLM's choice for the checkpoint dialect
        config = cls(
            vocab_size=int(f["vocab_size"]),
            hidden_size=int(f["hidden_size"]),
            num_hidden_layers=num_layers,
            intermediate_size=int(f["intermediate_size"]),
            rms_norm_eps=eps,
            num_attention_heads=int(f["num_attention_heads"]),
            q_lora_rank=f["q_lora_rank"] or None,
            kv_lora_rank=int(f["kv_lora_rank"]),
            qk_nope_head_dim=int(f["qk_nope_head_dim"]),
            qk_rope_head_dim=int(f["qk_rope_head_dim"]),
            v_head_dim=int(f["v_head_dim"]),
            mla_use_output_gate=bool(f.get("mla_use_output_gate", False)),
            mla_norm_eps=mla_norm_eps,
            kda_heads=int(f["linear_num_heads"]),
            kda_head_dim=int(f["linear_head_dim"]),
            conv_kernel_size=int(f["linear_conv_kernel_dim"]),
            gate_lower_bound=_gate_lower_bound(lac),
            use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            hidden_act=str(f["hidden_act"]),
            situ_beta=f.get("activation_situ_beta"),
            situ_linear_beta=f.get("activation_situ_linear_beta"),
            num_experts=int(f["num_experts"]),
            num_experts_per_token=int(f["num_experts_per_token"]),
            num_shared_experts=int(f["num_shared_experts"]),
            moe_intermediate_size=int(f["moe_intermediate_size"]),
            routed_expert_hidden_size=f.get("routed_expert_hidden_size") or None,
            latent_moe_use_norm=bool(f.get("latent_moe_use_norm", False)),
            scoring=str(f.get("moe_router_activation_func", "sigmoid")),
            num_expert_group=int(f["num_expert_group"]) if grouped else 1,
            topk_group=int(f["topk_group"]) if grouped else 1,
            moe_renormalize=bool(f["moe_renormalize"]),
            routed_scaling_factor=float(f["routed_scaling_factor"]),
            plan=plan,
        )
        config.validate(tp_size)
        return config

    def validate(self, tp_size: int) -> None:
        has_moe = bool(self.plan.moe_layers)
        if has_moe and (self.num_experts < 1 or self.num_experts_per_token < 1):
            raise ValueError(
                "MoE layers need num_experts and num_experts_per_token >= 1, got "
                f"{self.num_experts} and {self.num_experts_per_token}"
            )
        split = {
            "linear_attn_config.num_heads": self.kda_heads,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        if has_moe:
            split["moe_intermediate_size"] = self.moe_intermediate_size
            split["moe_intermediate_size * num_shared_experts"] = (
                self.moe_intermediate_size * self.num_shared_experts
            )
        for name, value in split.items():
            if value % tp_size:
                raise ValueError(
                    f"tensor_parallel_size={tp_size} does not divide {name}={value}"
                )

    @property
    def attn_res_block_size(self) -> int | None:
        return self.plan.attn_res_block_size

    @property
    def uses_attn_res(self) -> bool:
        return self.plan.uses_attn_res

    @property
    def kv_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_layers(self) -> frozenset[int]:
        return self.plan.kda_layers

    @property
    def mla_layers(self) -> frozenset[int]:
        return self.plan.mla_layers

    def is_kda_layer(self, layer: int) -> bool:
        return self.plan[layer].is_kda

    def is_moe_layer(self, layer: int) -> bool:
        return self.plan[layer].is_moe

    def blocks_before(self, layer: int) -> int:
        """AttnRes blocks closed before `layer` runs: ceil(layer / block_size)."""
        return self.plan.blocks_before(layer)


def _gate_lower_bound(lac: Mapping[str, Any]) -> float | None:
    lower_bound = lac.get("gate_lower_bound")
    if lower_bound is None:
        return None
    low, high = GATE_LOWER_BOUND_RANGE
    if not low <= lower_bound < high:
        raise ValueError(
            f"linear_attn_config.gate_lower_bound={lower_bound} lies outside "
            f"[{low}, {high})"
        )
    return float(lower_bound)


def _refuse_unsupported(text: Mapping[str, Any], f: Mapping[str, Any]) -> None:
    """Settings transformers or the checkpoints allow that atom's layers do not
    implement; loading them anyway would decode differently, not fail."""
    if f.get("mla_use_nope", True) is False:
        raise ValueError(
            "mla_use_nope: false is not supported; the Kimi target MLA is NoPE"
        )
    if f["attention_bias"]:
        raise ValueError("attention_bias: true is not supported (atom's MLA has none)")
    kv_heads = f.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != f["num_attention_heads"]:
        raise ValueError(
            f"num_key_value_heads={kv_heads} must equal num_attention_heads="
            f"{f['num_attention_heads']}: MLA expands one latent into every head"
        )
    # transformers' KimiLinear runs the KDA short conv through hidden_act; atom's
    # conv is SiLU, as in the Kimi checkpoints (whose SiTU FFNs keep a SiLU conv).
    if decodes_as_transformers(text) and f["hidden_act"] != "silu":
        raise ValueError(
            f"hidden_act={f['hidden_act']!r}: transformers' KimiLinear applies it to "
            "the KDA short conv too, which atom keeps SiLU; only silu decodes alike"
        )
