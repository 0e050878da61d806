"""Seeded, deterministic tensors for the tiny checkpoints, under the real names.

A checkpoint is first described as a manifest (name, shape, init rule) derived from its
config, then materialised. Each tensor draws from its own generator, seeded from the
checkpoint seed and the tensor name, so a tensor does not depend on generation order
and the K3 draft can reproduce its target's embedding table exactly.

Init rules: projections ~ N(0, 1/fan_in) so activations stay
O(1) through the stack; norms 1 + noise; non-zero AttnRes projections and router
correction bias; FLA-style `A_log` and `dt_bias`. Everything is float32.
"""

import math
import zlib
from typing import NamedTuple

import torch

from atom.models.kimi.config import KimiTextConfig

# Init rules, applied in `_init_tensor`.
EMBED = "embed"  # N(0, 1)
LINEAR = "linear"  # N(0, 1/fan_in), fan_in = last dim
HEAD = "head"  # LINEAR times HEAD_GAIN
NORM = "norm"  # 1 + N(0, 0.1^2)
A_LOG = "a_log"  # log U(1, 16)
DT_BIAS = "dt_bias"  # softplus^-1(log-uniform in [1e-3, 1e-1])
SMALL = "small"  # N(0, 0.05^2), biases
# Logit std ~2 instead of ~1: wider top-1 margins keep greedy argmax stable across
# numerically different but correct implementations.
HEAD_GAIN = 2.0
# Real K3 stores more A_log entries than KDA heads (128 for 96); mimic that.
K3_A_LOG_EXTRA = 2


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    init: str


def _kda_specs(p: str, cfg: dict, a_log_shape: tuple[int, ...]) -> list[TensorSpec]:
    lac = cfg["linear_attn_config"]
    hidden, heads, dim = cfg["hidden_size"], lac["num_heads"], lac["head_dim"]
    width, kernel = heads * dim, lac["short_conv_kernel_size"]
    specs = [TensorSpec(f"{p}{x}_proj.weight", (width, hidden), LINEAR) for x in "qkv"]
    specs += [
        TensorSpec(f"{p}{x}_conv1d.weight", (width, 1, kernel), LINEAR) for x in "qkv"
    ]
    specs += [
        TensorSpec(f"{p}f_a_proj.weight", (dim, hidden), LINEAR),
        TensorSpec(f"{p}f_b_proj.weight", (width, dim), LINEAR),
        TensorSpec(f"{p}b_proj.weight", (heads, hidden), LINEAR),
        TensorSpec(f"{p}A_log", a_log_shape, A_LOG),
        TensorSpec(f"{p}dt_bias", (width,), DT_BIAS),
        TensorSpec(f"{p}o_norm.weight", (dim,), NORM),
        TensorSpec(f"{p}o_proj.weight", (hidden, width), LINEAR),
    ]
    if lac.get("use_full_rank_gate", False):
        specs.append(TensorSpec(f"{p}g_proj.weight", (width, hidden), LINEAR))
    else:
        specs.append(TensorSpec(f"{p}g_a_proj.weight", (dim, hidden), LINEAR))
        specs.append(TensorSpec(f"{p}g_b_proj.weight", (width, dim), LINEAR))
    return specs


def mla_specs(p: str, cfg: dict) -> list[TensorSpec]:
    """MLA projections; shared by the targets and the DSpark draft."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora = cfg.get("q_lora_rank")
    kv_lora, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    qk_dim = cfg["qk_nope_head_dim"] + rope
    v_dim = cfg["v_head_dim"]
    if q_lora:
        specs = [
            TensorSpec(f"{p}q_a_proj.weight", (q_lora, hidden), LINEAR),
            TensorSpec(f"{p}q_a_layernorm.weight", (q_lora,), NORM),
            TensorSpec(f"{p}q_b_proj.weight", (heads * qk_dim, q_lora), LINEAR),
        ]
    else:
        specs = [TensorSpec(f"{p}q_proj.weight", (heads * qk_dim, hidden), LINEAR)]
    specs += [
        TensorSpec(f"{p}kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), LINEAR),
        TensorSpec(f"{p}kv_a_layernorm.weight", (kv_lora,), NORM),
        TensorSpec(
            f"{p}kv_b_proj.weight",
            (heads * (cfg["qk_nope_head_dim"] + v_dim), kv_lora),
            LINEAR,
        ),
        TensorSpec(f"{p}o_proj.weight", (hidden, heads * v_dim), LINEAR),
    ]
    if cfg.get("mla_use_output_gate", False):
        specs.append(TensorSpec(f"{p}g_proj.weight", (heads * v_dim, hidden), LINEAR))
    return specs


def mlp_specs(p: str, hidden: int, inner: int) -> list[TensorSpec]:
    """A gated MLP: gate/up [inner, hidden] and down [hidden, inner]."""
    return [
        TensorSpec(f"{p}gate_proj.weight", (inner, hidden), LINEAR),
        TensorSpec(f"{p}up_proj.weight", (inner, hidden), LINEAR),
        TensorSpec(f"{p}down_proj.weight", (hidden, inner), LINEAR),
    ]


def _moe_specs(p: str, cfg: dict) -> list[TensorSpec]:
    hidden, experts = cfg["hidden_size"], cfg["num_experts"]
    inner = cfg["moe_intermediate_size"]
    latent = cfg.get("routed_expert_hidden_size")
    expert_in = latent or hidden
    specs = [
        TensorSpec(f"{p}gate.weight", (experts, hidden), LINEAR),
        TensorSpec(f"{p}gate.e_score_correction_bias", (experts,), SMALL),
    ]
    if latent:
        specs += [
            TensorSpec(f"{p}routed_expert_down_proj.weight", (latent, hidden), LINEAR),
            TensorSpec(f"{p}routed_expert_up_proj.weight", (hidden, latent), LINEAR),
        ]
        if cfg.get("latent_moe_use_norm", False):
            specs.append(TensorSpec(f"{p}routed_expert_norm.weight", (latent,), NORM))
    for e in range(experts):
        specs += [
            TensorSpec(f"{p}experts.{e}.w1.weight", (inner, expert_in), LINEAR),
            TensorSpec(f"{p}experts.{e}.w2.weight", (expert_in, inner), LINEAR),
            TensorSpec(f"{p}experts.{e}.w3.weight", (inner, expert_in), LINEAR),
        ]
    shared = inner * cfg["num_shared_experts"]
    return specs + mlp_specs(f"{p}shared_experts.", hidden, shared)


def text_model_specs(
    cfg: dict, prefix: str, a_log_shape: tuple[int, ...]
) -> list[TensorSpec]:
    """Every tensor of a Kimi Linear / K3 text stack, names under `prefix`."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    plan = KimiTextConfig.from_hf(cfg).plan
    attn_res = plan.uses_attn_res
    m = f"{prefix}model."
    specs = [TensorSpec(f"{m}embed_tokens.weight", (vocab, hidden), EMBED)]
    for layer in plan:
        lp = f"{m}layers.{layer.index}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if attn_res:
            norms += ["self_attention_res_norm", "mlp_res_norm"]
            specs += [
                TensorSpec(f"{lp}{site}_res_proj.weight", (1, hidden), LINEAR)
                for site in ("self_attention", "mlp")
            ]
        specs += [TensorSpec(f"{lp}{n}.weight", (hidden,), NORM) for n in norms]
        if layer.is_kda:
            specs += _kda_specs(f"{lp}self_attn.", cfg, a_log_shape)
        else:
            specs += mla_specs(f"{lp}self_attn.", cfg)
        if layer.is_moe:
            specs += _moe_specs(f"{lp}block_sparse_moe.", cfg)
        else:
            specs += mlp_specs(f"{lp}mlp.", hidden, cfg["intermediate_size"])
    specs.append(TensorSpec(f"{m}norm.weight", (hidden,), NORM))
    if attn_res:
        specs.append(TensorSpec(f"{m}output_attn_res_norm.weight", (hidden,), NORM))
        specs.append(TensorSpec(f"{m}output_attn_res_proj.weight", (1, hidden), LINEAR))
    specs.append(TensorSpec(f"{prefix}lm_head.weight", (vocab, hidden), HEAD))
    return specs


def kimi_linear_specs(cfg: dict) -> list[TensorSpec]:
    heads = cfg["linear_attn_config"]["num_heads"]
    # Legacy 4-D A_log, as Kimi Linear checkpoints and transformers store it.
    return text_model_specs(cfg, "", (1, 1, heads, 1))


def k3_specs(cfg: dict) -> list[TensorSpec]:
    """K3 / K3.1 layout: text stack under `language_model.` plus stub vision tensors."""
    text, vision = cfg["text_config"], cfg["vision_config"]
    heads = text["linear_attn_config"]["num_heads"]
    width = vision["hidden_size"]
    merged = width * math.prod(vision["merge_kernel_size"])
    patch = (width, vision["num_channels"], vision["patch_size"], vision["patch_size"])
    return [
        TensorSpec("vision_tower.patch_embed.proj.weight", patch, LINEAR),
        TensorSpec("vision_tower.encoder.final_layernorm.weight", (width,), NORM),
        TensorSpec("mm_projector.pre_norm.weight", (width,), NORM),
        TensorSpec("mm_projector.proj.0.weight", (text["hidden_size"], merged), LINEAR),
    ] + text_model_specs(text, "language_model.", (heads + K3_A_LOG_EXTRA,))


def dspark_specs(cfg: dict, with_embedding: bool) -> list[TensorSpec]:
    """DSpark draft tensors; no prefix, no lm_head."""
    hidden, vocab, rank = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    taps_width = cfg["num_target_layers"] * cfg["target_hidden_size"]
    specs = [
        TensorSpec("context_proj.weight", (hidden, taps_width), LINEAR),
        TensorSpec("context_norm.weight", (hidden,), NORM),
    ]
    for i in range(cfg["num_hidden_layers"]):
        lp = f"layers.{i}."
        specs += [
            TensorSpec(f"{lp}input_layernorm.weight", (hidden,), NORM),
            TensorSpec(f"{lp}post_attention_layernorm.weight", (hidden,), NORM),
        ]
        specs += mla_specs(f"{lp}self_attn.", cfg)
        specs += mlp_specs(f"{lp}mlp.", hidden, cfg["intermediate_size"])
    return specs + draft_tail_specs("final_norm", hidden, vocab, rank, with_embedding)


def draft_tail_specs(
    norm: str, hidden: int, vocab: int, rank: int, with_embedding: bool
) -> list[TensorSpec]:
    """What every DSpark draft ends with: the final norm `norm`, the Markov and
    confidence heads and, when the draft stores its own, the embedding."""
    specs = [
        TensorSpec(f"{norm}.weight", (hidden,), NORM),
        TensorSpec("markov_head.markov_w1.weight", (vocab, rank), LINEAR),
        TensorSpec("markov_head.markov_w2.weight", (vocab, rank), LINEAR),
        TensorSpec("confidence_head.proj.weight", (1, hidden + rank), LINEAR),
        TensorSpec("confidence_head.bias", (1,), SMALL),
    ]
    if with_embedding:
        specs.append(TensorSpec("embed_tokens.weight", (vocab, hidden), EMBED))
    return specs


def _generator(seed: int, name: str) -> torch.Generator:
    # CPU generators keep only the low 32 bits of a seed, so hash seed and name together.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _init_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    gen = _generator(seed, spec.name)
    shape = spec.shape

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen) * (high - low) + low

    if spec.init == EMBED:
        return torch.randn(shape, generator=gen)
    if spec.init == LINEAR:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if spec.init == HEAD:
        return HEAD_GAIN * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if spec.init == NORM:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if spec.init == SMALL:
        return 0.05 * torch.randn(shape, generator=gen)
    if spec.init == A_LOG:
        return uniform(1.0, 16.0).log()
    if spec.init == DT_BIAS:
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    raise ValueError(f"unknown init rule {spec.init!r} for {spec.name}")


def materialize(
    specs: list[TensorSpec], seed: int, copies: dict[str, tuple[str, int]] | None = None
) -> dict[str, torch.Tensor]:
    """Create every tensor; `copies` maps a name to (source name, source seed)."""
    copies = copies or {}
    tensors = {}
    for spec in specs:
        source = spec
        source_seed = seed
        if spec.name in copies:
            source_name, source_seed = copies[spec.name]
            source = spec._replace(name=source_name)
        tensors[spec.name] = _init_tensor(source, source_seed).contiguous()
    return tensors
