"""Configs and tensor manifests of the tiny MiniMax-M3 target and its Qwen3-style
DSpark draft (the builders are in `minimax.py`).

Every path is alive at tp 1/2/4 and pp 2/4: 2 KV heads (tp 4 replicates them and the
index heads), layers 0-1 dense with full attention and 2-5 MoE with block-sparse
attention (pp2: stage 0 holds both kinds), index blocks of 4 positions and top-2
blocks (prompts past 8 tokens exercise selection), a router bias large enough to
flip choices, and expert 0 scaled so its pre-activations cross the swigluoai clamps.
The vocabulary is the tiny tokenizer's (TINY_VOCAB_SIZE ids, the same BPE).
"""

from __future__ import annotations

import torch

from atom.models.tiny.configs import TINY_VOCAB_SIZE, TOKEN_IDS
from atom.models.tiny.weights import (
    EMBED,
    HEAD,
    LINEAR,
    NORM,
    SMALL,
    TensorSpec,
    draft_tail_specs,
    materialize,
    mlp_specs,
)

MINIMAX_SEED, MINIMAX_DRAFT_SEED = 23, 223
TARGET_EMBED_NAME = "language_model.model.embed_tokens.weight"
# SMALL init is N(0, 0.05^2); the router bias must be large enough to flip choices.
ROUTER_BIAS_GAIN = 10.0
# Expert 0's gate/up weights are scaled so |g|, |u| exceed swiglu_limit = 7 often.
CLAMPED_EXPERT_GAIN = 12.0
NUM_LAYERS = 6
DRAFT_TAP_IDS = [1, 4]
# The draft is distilled on blocks of 7 rows: k = 7 speculative tokens.
DRAFT_BLOCK_SIZE = 7
SPARSE_LAYERS = [0, 0, 1, 1, 1, 1]


def minimax_text_config() -> dict:
    """The released-dialect `text_config` of tiny-minimax-m3."""
    return {
        "model_type": "minimax_m3_vl_text",
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 8,
        "partial_rotary_factor": 0.5,
        "rope_theta": 5e6,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "use_gemma_norm": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "moe_layer_freq": list(SPARSE_LAYERS),
        "dense_intermediate_size": 96,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "n_shared_experts": 1,
        "shared_intermediate_size": 32,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 2.0,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_attention_freq": list(SPARSE_LAYERS),
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 16,
            "sparse_block_size": 4,
            "sparse_topk_blocks": 2,
            "sparse_local_block": 1,
            "sparse_init_block": 0,
            "sparse_score_type": "max",
            "sparse_disable_index_value": list(SPARSE_LAYERS),
        },
        "num_mtp_modules": 0,
        "attention_output_gate": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **{k: TOKEN_IDS[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }


def minimax_config() -> dict:
    """The multimodal wrapper around `minimax_text_config` (vision is skipped)."""
    special = {
        k: TOKEN_IDS[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        **special,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "text_config": minimax_text_config(),
        "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "patch_size": 2},
    }


def minimax_dspark_config(target_text: dict, tap_ids: list[int]) -> dict:
    """A tiny `Qwen3DSparkModel` draft for `target_text` (DFlash-style config)."""
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        # The draft embeds with the target's table, so the widths must agree.
        "hidden_size": target_text["hidden_size"],
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "vocab_size": target_text["vocab_size"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        # Qwen3Config drops sliding_window unless use_sliding_window: atom reads the
        # window from dflash_config.
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dflash_config": {
            "block_size": DRAFT_BLOCK_SIZE,
            "target_layer_ids": list(tap_ids),
            "num_target_layers": target_text["num_hidden_layers"],
            "mask_token_id": TOKEN_IDS["mask_token_id"],
            "markov_rank": 16,
            "markov_head_type": "vanilla",
            "use_swa": True,
            "swa_window_size": 16,
            "causal": False,
            "use_confidence_head": True,
            "projector_type": "dspark",
        },
    }


def _attention_specs(
    p: str, cfg: dict, sparse: bool, norm_init: str = SMALL
) -> list[TensorSpec]:
    """q/k/v/o projections and per-head QK norms (init `norm_init`), plus the
    lightning indexer's on sparse layers."""
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q_rows = cfg["num_attention_heads"] * head_dim
    kv_rows = cfg["num_key_value_heads"] * head_dim
    specs = [
        TensorSpec(f"{p}q_proj.weight", (q_rows, hidden), LINEAR),
        TensorSpec(f"{p}k_proj.weight", (kv_rows, hidden), LINEAR),
        TensorSpec(f"{p}v_proj.weight", (kv_rows, hidden), LINEAR),
        TensorSpec(f"{p}o_proj.weight", (hidden, q_rows), LINEAR),
        TensorSpec(f"{p}q_norm.weight", (head_dim,), norm_init),
        TensorSpec(f"{p}k_norm.weight", (head_dim,), norm_init),
    ]
    if sparse:
        sparse_cfg = cfg["sparse_attention_config"]
        dim = sparse_cfg["sparse_index_dim"]
        heads = sparse_cfg["sparse_num_index_heads"]
        specs += [
            TensorSpec(f"{p}index_q_proj.weight", (heads * dim, hidden), LINEAR),
            TensorSpec(f"{p}index_k_proj.weight", (dim, hidden), LINEAR),
            TensorSpec(f"{p}index_q_norm.weight", (dim,), SMALL),
            TensorSpec(f"{p}index_k_norm.weight", (dim,), SMALL),
        ]
    return specs


def _moe_specs(p: str, cfg: dict) -> list[TensorSpec]:
    hidden, experts = cfg["hidden_size"], cfg["num_local_experts"]
    inner = cfg["intermediate_size"]
    specs = [
        TensorSpec(f"{p}gate.weight", (experts, hidden), LINEAR),
        TensorSpec(f"{p}e_score_correction_bias", (experts,), SMALL),
    ]
    for e in range(experts):
        specs += [
            TensorSpec(f"{p}experts.{e}.w1.weight", (inner, hidden), LINEAR),
            TensorSpec(f"{p}experts.{e}.w2.weight", (hidden, inner), LINEAR),
            TensorSpec(f"{p}experts.{e}.w3.weight", (inner, hidden), LINEAR),
        ]
    shared = cfg["shared_intermediate_size"] * cfg["n_shared_experts"]
    return specs + mlp_specs(f"{p}shared_experts.", hidden, shared)


def minimax_specs(cfg: dict) -> list[TensorSpec]:
    """Released-layout tensors of tiny-minimax-m3, stub vision tensors included.

    GemmaNorm weights are offsets from 1, so they take the SMALL (non-zero) init.
    """
    text = cfg["text_config"]
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    sparse_cfg = text["sparse_attention_config"]
    m = "language_model.model."
    specs = [
        TensorSpec("vision_tower.vision_model.pre_layrnorm.weight", (32,), NORM),
        TensorSpec("multi_modal_projector.linear_1.weight", (hidden, 32), LINEAR),
        TensorSpec("patch_merge_mlp.linear_1.weight", (hidden, 4 * hidden), LINEAR),
        TensorSpec(f"{m}embed_tokens.weight", (vocab, hidden), EMBED),
    ]
    for i in range(text["num_hidden_layers"]):
        lp = f"{m}layers.{i}."
        specs += [
            TensorSpec(f"{lp}input_layernorm.weight", (hidden,), SMALL),
            TensorSpec(f"{lp}post_attention_layernorm.weight", (hidden,), SMALL),
        ]
        sparse = bool(sparse_cfg["sparse_attention_freq"][i])
        specs += _attention_specs(f"{lp}self_attn.", text, sparse)
        if text["moe_layer_freq"][i]:
            specs += _moe_specs(f"{lp}block_sparse_moe.", text)
        else:
            specs += mlp_specs(f"{lp}mlp.", hidden, text["dense_intermediate_size"])
    specs.append(TensorSpec(f"{m}norm.weight", (hidden,), SMALL))
    specs.append(TensorSpec("language_model.lm_head.weight", (vocab, hidden), HEAD))
    return specs


def dspark_draft_specs(cfg: dict, with_embedding: bool) -> list[TensorSpec]:
    """`Qwen3DSparkModel` tensors (no `model.` prefix, no lm_head)."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    dflash = cfg["dflash_config"]
    rank = dflash["markov_rank"]
    specs = [
        TensorSpec(
            "fc.weight", (hidden, len(dflash["target_layer_ids"]) * hidden), LINEAR
        ),
        TensorSpec("hidden_norm.weight", (hidden,), NORM),
    ]
    for i in range(cfg["num_hidden_layers"]):
        lp = f"layers.{i}."
        specs += [
            TensorSpec(f"{lp}input_layernorm.weight", (hidden,), NORM),
            TensorSpec(f"{lp}post_attention_layernorm.weight", (hidden,), NORM),
        ]
        specs += _attention_specs(f"{lp}self_attn.", cfg, sparse=False, norm_init=NORM)
        specs += mlp_specs(f"{lp}mlp.", hidden, cfg["intermediate_size"])
    return specs + draft_tail_specs("norm", hidden, vocab, rank, with_embedding)


def target_specs() -> list[TensorSpec]:
    return minimax_specs(minimax_config())


def draft_config() -> dict:
    return minimax_dspark_config(minimax_text_config(), DRAFT_TAP_IDS)


def draft_specs() -> list[TensorSpec]:
    """The draft's own tensors (no `embed_tokens`)."""
    return dspark_draft_specs(draft_config(), with_embedding=False)


def initial_target() -> dict[str, torch.Tensor]:
    """The seeded init of tiny-minimax-m3, with the router-bias and clamp gains."""
    tensors = materialize(target_specs(), MINIMAX_SEED)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensor.mul_(ROUTER_BIAS_GAIN)
        if ".experts.0.w1." in name or ".experts.0.w3." in name:
            tensor.mul_(CLAMPED_EXPERT_GAIN)
    return tensors


def initial_draft() -> dict[str, torch.Tensor]:
    return materialize(draft_specs(), MINIMAX_DRAFT_SEED)
