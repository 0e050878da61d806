"""config.json contents of the tiny checkpoints (docs/tiny_models.md).

Field names follow the published checkpoints and transformers' `KimiLinearConfig`
serialisation (`num_experts`, `num_experts_per_token`, `num_shared_experts`,
`num_expert_group`, `moe_renormalize`, a `linear_attn_config` with 1-based layer ids),
so `transformers.AutoConfig` reads the Kimi Linear one unchanged.
"""

from atom.models.tiny.tokenizer import bos_eos_pad_mask_ids

TINY_VOCAB_SIZE = 4096
TOKEN_IDS = bos_eos_pad_mask_ids(TINY_VOCAB_SIZE)
_SPECIAL_IDS = {
    key: TOKEN_IDS[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
}

# Widths shared by every tiny target (docs/tiny_models.md, "Sizes").
_COMMON_TEXT = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 64,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "moe_renormalize": True,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "float32",
}


def kimi_linear_config() -> dict:
    """TINY-KL: flat Kimi Linear config (no AttnRes, latent MoE, lower bound, gates)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        **_COMMON_TEXT,
        **_SPECIAL_IDS,
        "num_hidden_layers": 4,
        "hidden_act": "silu",
        "q_lora_rank": None,
        "mla_use_output_gate": False,
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "use_full_rank_gate": False,
        },
        "num_shared_experts": 1,
        "num_expert_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.446,
    }


def k3_text_config() -> dict:
    """TINY-K3-8: the `text_config` of the tiny K3 / K3.1 targets."""
    return {
        "model_type": "kimi_linear",
        **_COMMON_TEXT,
        **_SPECIAL_IDS,
        "num_hidden_layers": 8,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "q_lora_rank": 64,
        "mla_use_output_gate": True,
        # Real K3 configs carry rope fields that NoPE MLA must ignore.
        "rope_theta": 50000.0,
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 3, 5, 6],
            "full_attn_layers": [2, 4, 7, 8],
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_shared_experts": 2,
        "routed_expert_hidden_size": 64,
        "latent_moe_use_norm": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "attn_res_block_size": 2,
    }


def k3_vision_config() -> dict:
    """A small MoonViT-shaped vision config; atom skips the vision tower."""
    return {
        "model_type": "moonvit3d",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 2,
        "num_channels": 3,
        "merge_kernel_size": [2, 2],
    }


def k3_config(architecture: str) -> dict:
    """Multimodal K3-layout wrapper around `k3_text_config`."""
    return {
        "architectures": [architecture],
        "model_type": "kimi_k3",
        **_SPECIAL_IDS,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": k3_text_config(),
        "vision_config": k3_vision_config(),
    }


def dspark_config(target_text_config: dict) -> dict:
    """Tiny `K3DSparkModel` draft for a TINY-K3-8 target (docs/dspark.md)."""
    target = target_text_config
    return {
        "architectures": ["K3DSparkModel"],
        "model_type": "k3_dspark",
        # The draft embeds with the target table, so the widths must agree.
        "hidden_size": target["hidden_size"],
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": target["kv_lora_rank"],
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": target["qk_rope_head_dim"],
        "v_head_dim": 32,
        "mla_use_nope": False,
        "mla_use_output_gate": False,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": target["vocab_size"],
        "rms_norm_eps": 1e-5,
        "num_target_layers": 4,
        "target_hidden_size": target["hidden_size"],
        "target_num_hidden_layers": target["num_hidden_layers"],
        "target_layer_ids": [-1, 1, 4, 6],
        "mask_token_id": TOKEN_IDS["mask_token_id"],
        "markov_rank": 16,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "torch_dtype": "float32",
    }


def generation_config() -> dict:
    return {**_SPECIAL_IDS, "do_sample": False}
