"""The Kimi Linear / K3 text config, normalised and validated (kimi_k3.md section 2).

HF and ATOM spell several fields differently, and the layer lists are 1-based. Every
model module reads this one normalised view, so neither quirk leaks into the layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# (alias, canonical field): both spellings appear in published configs.
FIELD_ALIASES: tuple[tuple[str, str], ...] = (
    ("n_routed_experts", "num_experts"),
    ("num_local_experts", "num_experts"),
    ("num_experts_per_tok", "num_experts_per_token"),
    ("n_shared_experts", "num_shared_experts"),
    ("norm_topk_prob", "moe_renormalize"),
    ("scoring_func", "moe_router_activation_func"),
    ("n_group", "num_expert_group"),
)

GATE_LOWER_BOUND_RANGE = (-5.0, 0.0)


def canonical_fields(text: Mapping[str, Any]) -> dict[str, Any]:
    """`text` with every alias folded into its canonical name (conflicts rejected)."""
    fields = dict(text)
    for alias, canonical in FIELD_ALIASES:
        if alias not in fields:
            continue
        value = fields.pop(alias)
        if canonical in fields and fields[canonical] != value:
            raise ValueError(
                f"config sets both {canonical}={fields[canonical]!r} and its alias "
                f"{alias}={value!r}"
            )
        fields[canonical] = value
    return fields


def _require(fields: Mapping[str, Any], name: str, where: str = "config") -> Any:
    if fields.get(name) is None:
        raise ValueError(f"{where} is missing the required field {name!r}")
    return fields[name]


def _zero_based(ids: Any, name: str, num_layers: int) -> frozenset[int]:
    if not isinstance(ids, list | tuple) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"linear_attn_config.{name} must be a list of layer ids")
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"linear_attn_config.{name} holds {bad}, outside the 1-based range "
            f"1..{num_layers}"
        )
    return frozenset(i - 1 for i in ids)


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
    kda_layers: frozenset[int]
    mla_layers: frozenset[int]
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
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring: str
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    # AttnRes (None: plain residual stream)
    attn_res_block_size: int | None

    @classmethod
    def from_hf(cls, text: Mapping[str, Any], tp_size: int = 1) -> KimiTextConfig:
        """Normalise a text config (flat Kimi Linear or K3 `text_config`)."""
        f = canonical_fields(text)
        num_layers = int(_require(f, "num_hidden_layers"))
        lac = _require(f, "linear_attn_config")
        where = "linear_attn_config"
        kda = _zero_based(_require(lac, "kda_layers", where), "kda_layers", num_layers)
        mla = _zero_based(
            _require(lac, "full_attn_layers", where), "full_attn_layers", num_layers
        )
        if kda & mla:
            raise ValueError(
                f"layers {sorted(i + 1 for i in kda & mla)} (1-based) are listed as "
                "both KDA and full attention"
            )
        untyped = set(range(num_layers)) - kda - mla
        if untyped:
            raise ValueError(
                f"layers {sorted(i + 1 for i in untyped)} (1-based) are in neither "
                "kda_layers nor full_attn_layers"
            )
        if f.get("mla_use_nope", True) is False:
            raise ValueError(
                "mla_use_nope: false is not supported; the Kimi target MLA is NoPE"
            )
        lower_bound = lac.get("gate_lower_bound")
        if lower_bound is not None:
            low, high = GATE_LOWER_BOUND_RANGE
            if not low <= lower_bound < high:
                raise ValueError(
                    f"linear_attn_config.gate_lower_bound={lower_bound} lies outside "
                    f"[{low}, {high})"
                )
            lower_bound = float(lower_bound)
        grouped = f.get("use_grouped_topk", True)
        eps = float(f.get("rms_norm_eps", 1e-5))
        config = cls(
            vocab_size=int(_require(f, "vocab_size")),
            hidden_size=int(_require(f, "hidden_size")),
            num_hidden_layers=num_layers,
            intermediate_size=int(_require(f, "intermediate_size")),
            rms_norm_eps=eps,
            num_attention_heads=int(_require(f, "num_attention_heads")),
            q_lora_rank=f.get("q_lora_rank") or None,
            kv_lora_rank=int(_require(f, "kv_lora_rank")),
            qk_nope_head_dim=int(_require(f, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_require(f, "qk_rope_head_dim")),
            v_head_dim=int(_require(f, "v_head_dim")),
            mla_use_output_gate=bool(f.get("mla_use_output_gate", False)),
            # transformers pins the q_a/kv_a norm eps at 1e-6; vLLM uses rms_norm_eps.
            mla_norm_eps=float(f.get("mla_norm_eps", eps)),
            kda_heads=int(_require(lac, "num_heads", where)),
            kda_head_dim=int(_require(lac, "head_dim", where)),
            conv_kernel_size=int(lac.get("short_conv_kernel_size", 4)),
            gate_lower_bound=lower_bound,
            use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            kda_layers=kda,
            mla_layers=mla,
            hidden_act=str(f.get("hidden_act", "silu")),
            situ_beta=f.get("activation_situ_beta"),
            situ_linear_beta=f.get("activation_situ_linear_beta"),
            num_experts=int(f.get("num_experts", 0)),
            num_experts_per_token=int(f.get("num_experts_per_token", 0)),
            num_shared_experts=int(f.get("num_shared_experts", 0)),
            moe_intermediate_size=int(f.get("moe_intermediate_size", 0)),
            routed_expert_hidden_size=f.get("routed_expert_hidden_size") or None,
            latent_moe_use_norm=bool(f.get("latent_moe_use_norm", False)),
            first_k_dense_replace=int(f.get("first_k_dense_replace", 0)),
            moe_layer_freq=int(f.get("moe_layer_freq", 1)),
            scoring=str(f.get("moe_router_activation_func", "sigmoid")),
            num_expert_group=int(f.get("num_expert_group", 1)) if grouped else 1,
            topk_group=int(f.get("topk_group", 1)) if grouped else 1,
            moe_renormalize=bool(f.get("moe_renormalize", True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", 1.0)),
            attn_res_block_size=f.get("attn_res_block_size"),
        )
        config.validate(tp_size)
        return config

    def validate(self, tp_size: int) -> None:
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(
                f"attn_res_block_size must be >= 1, got {self.attn_res_block_size}"
            )
        has_moe = any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
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
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def kv_latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_kda_layer(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def blocks_before(self, layer: int) -> int:
        """AttnRes blocks closed before `layer` runs: ceil(layer / block_size)."""
        if self.attn_res_block_size is None:
            return 0
        return -(-layer // self.attn_res_block_size)
