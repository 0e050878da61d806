"""How a Kimi text config.json spells each fact, and what an absent fact means.

Two dialects describe the same model:

- transformers' `KimiLinearConfig`, as `save_pretrained` writes it: `layer_types`
  (`"linear_attention"` / `"full_attention"`), `mlp_layer_types` (`"dense"` /
  `"sparse"`), `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`, and
  the MoE sizes under one of several spellings (`num_experts`, `num_local_experts`,
  `n_routed_experts`, ... depending on the transformers release).
- the checkpoint dialect of the published Kimi Linear and Kimi-K3 `text_config`: a
  `linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`, `num_heads`,
  `head_dim`, `short_conv_kernel_size`, the dense/MoE rule `first_k_dense_replace` /
  `moe_layer_freq`, and K3's additions (AttnRes, latent MoE, SiTU, gates), which
  transformers does not know.

transformers keeps keys it does not know, so one config.json may carry both. Every
fact is read from whichever spellings are present; two spellings with different values
are an error naming both. A fact no spelling carries takes the default of
transformers' `KimiLinearConfig` (transformers 5.24).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"

# transformers' KimiLinearConfig defaults, under atom's field names (moe_layer_freq,
# which transformers ignores, defaults to 1: every layer from first_k on is MoE).
TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "moe_renormalize": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "linear_num_heads": 32,
    "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
}

# transformers' KimiLinearAttention builds q_a / kv_a norms with a fixed eps of 1e-6.
TRANSFORMERS_MLA_NORM_EPS = 1e-6

# atom's name -> the other spellings of the same field across transformers releases,
# the Kimi checkpoints and DeepSeek-style configs.
ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "moe_renormalize": ("norm_topk_prob",),
    "num_expert_group": ("n_group",),
    "moe_router_activation_func": ("scoring_func",),
}

# transformers' top-level KDA field -> its key inside `linear_attn_config`.
LINEAR_ATTENTION_KEYS: dict[str, str] = {
    "linear_num_heads": "num_heads",
    "linear_head_dim": "head_dim",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}

_ATTENTION_TYPES = {"linear_attention": KDA, "full_attention": MLA}
_MLP_TYPES = {"dense": DENSE, "sparse": MOE}


# K3 features transformers' KimiLinear does not implement (SiTU via hidden_act).
K3_ADDITIONS = (
    "attn_res_block_size",
    "mla_use_output_gate",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
)
K3_LINEAR_ATTENTION_ADDITIONS = ("gate_lower_bound", "use_full_rank_gate")


def written_by_transformers(text: Mapping[str, Any]) -> bool:
    """transformers 5 serialises both schedules; the checkpoint dialect has neither."""
    return "layer_types" in text or "mlp_layer_types" in text


def decodes_as_transformers(text: Mapping[str, Any]) -> bool:
    """transformers wrote the config and it uses no K3 addition, so transformers'
    KimiLinear is the reference for what its unstated details mean."""
    if not written_by_transformers(text) or text.get("hidden_act") == "situ":
        return False
    lac = linear_attn_config(text)
    return not any(text.get(name) for name in K3_ADDITIONS) and not any(
        lac.get(name) for name in K3_LINEAR_ATTENTION_ADDITIONS
    )


def _agreed(spellings: Sequence[tuple[str, Any]]) -> Any:
    """The one value all present spellings give (None when none is present)."""
    present = [(name, value) for name, value in spellings if value is not None]
    for name, value in present[1:]:
        first_name, first_value = present[0]
        if value != first_value:
            raise ValueError(
                f"config sets {first_name}={first_value!r} and {name}={value!r}, "
                "two spellings of one field"
            )
    return present[0][1] if present else None


def read_fields(text: Mapping[str, Any]) -> dict[str, Any]:
    """`text` with every aliased field under atom's name and transformers' defaults
    filled in; the KDA widths come from `linear_attn_config` or the top level."""
    spelled = {alias for aliases in ALIASES.values() for alias in aliases}
    fields = {name: value for name, value in text.items() if name not in spelled}
    for name, aliases in ALIASES.items():
        value = _agreed([(n, text.get(n)) for n in (name, *aliases)])
        if value is not None:
            fields[name] = value
    lac = linear_attn_config(text)
    for name, key in LINEAR_ATTENTION_KEYS.items():
        value = _agreed(
            [(name, text.get(name)), (f"linear_attn_config.{key}", lac.get(key))]
        )
        if value is not None:
            fields[name] = value
    for name, default in TRANSFORMERS_DEFAULTS.items():
        if fields.get(name) is None:
            fields[name] = default
    return fields


def linear_attn_config(text: Mapping[str, Any]) -> Mapping[str, Any]:
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, Mapping):
        raise ValueError(f"linear_attn_config must be an object, got {lac!r}")
    return lac


def _from_types(
    types: Any, name: str, kinds: Mapping[str, str], num_layers: int
) -> list[str] | None:
    """Per-layer kinds from transformers' flat list `name` (`layer_types`,
    `mlp_layer_types`), each entry a key of `kinds`; None when it is absent."""
    if types is None:
        return None
    if not isinstance(types, list | tuple) or len(types) != num_layers:
        raise ValueError(
            f"{name} must list {num_layers} entries (num_hidden_layers), "
            f"got {types!r}"
        )
    bad = sorted({t for t in types if t not in kinds}, key=str)
    if bad:
        raise ValueError(f"{name} holds {bad}; allowed: {', '.join(kinds)}")
    return [kinds[t] for t in types]


def _zero_based(ids: Any, name: str, num_layers: int) -> set[int]:
    if not isinstance(ids, list | tuple) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"linear_attn_config.{name} must be a list of layer ids")
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"linear_attn_config.{name} holds {bad}, outside the 1-based range "
            f"1..{num_layers}"
        )
    return {i - 1 for i in ids}


def _from_layer_lists(lac: Mapping[str, Any], num_layers: int) -> list[str] | None:
    """Per-layer kinds from the 1-based `kda_layers` / `full_attn_layers`."""
    has = [key in lac for key in ("kda_layers", "full_attn_layers")]
    if not any(has):
        return None
    if not all(has):
        missing = "full_attn_layers" if has[0] else "kda_layers"
        raise ValueError(f"linear_attn_config lists layers but lacks {missing}")
    kda = _zero_based(lac["kda_layers"], "kda_layers", num_layers)
    mla = _zero_based(lac["full_attn_layers"], "full_attn_layers", num_layers)
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
    return [KDA if i in kda else MLA for i in range(num_layers)]


def _differing(a: list[str], b: list[str]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def attention_schedule(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """KDA or MLA per 0-based layer: `layer_types`, the `linear_attn_config` lists,
    or transformers' default (MLA at every fourth layer after layer 0)."""
    by_types = _from_types(
        text.get("layer_types"), "layer_types", _ATTENTION_TYPES, num_layers
    )
    by_lists = _from_layer_lists(linear_attn_config(text), num_layers)
    if by_types and by_lists and by_types != by_lists:
        raise ValueError(
            "layer_types and linear_attn_config.kda_layers/full_attn_layers "
            f"disagree at 0-based layers {_differing(by_types, by_lists)}"
        )
    schedule = by_types or by_lists
    if schedule is None:
        schedule = [MLA if i and i % 4 == 0 else KDA for i in range(num_layers)]
    return tuple(schedule)


def ffn_schedule(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Dense or MoE per 0-based layer: `mlp_layer_types`, or the checkpoint rule
    (MoE iff layer >= first_k_dense_replace and layer % moe_layer_freq == 0)."""
    by_types = _from_types(
        text.get("mlp_layer_types"), "mlp_layer_types", _MLP_TYPES, num_layers
    )
    has_rule = any(
        text.get(name) is not None
        for name in ("first_k_dense_replace", "moe_layer_freq")
    )
    first_k = int(_or_default(text, "first_k_dense_replace"))
    freq = int(_or_default(text, "moe_layer_freq"))
    if freq < 1:
        raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
    by_rule = [
        MOE if i >= first_k and i % freq == 0 else DENSE for i in range(num_layers)
    ]
    if by_types is None:
        return tuple(by_rule)
    if has_rule and by_types != by_rule:
        raise ValueError(
            f"mlp_layer_types and first_k_dense_replace={first_k}, "
            f"moe_layer_freq={freq} disagree at 0-based layers "
            f"{_differing(by_types, by_rule)}"
        )
    return tuple(by_types)


def _or_default(text: Mapping[str, Any], name: str) -> Any:
    value = text.get(name)
    return TRANSFORMERS_DEFAULTS[name] if value is None else value
