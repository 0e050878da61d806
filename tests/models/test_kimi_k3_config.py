"""KimiTextConfig: 1-based layer lists, aliases, validation, and TP shard shapes."""

import copy

import pytest
import torch

from atom.config import Config
from atom.distributed.parallel_state import build_parallel_state
from atom.models.kimi.config import KimiTextConfig
from atom.models.kimi.model import KimiLinearModel
from atom.models.tiny.configs import (
    TINY_VOCAB_SIZE,
    k3_text_config,
    kimi_linear_config,
)
from tests.models.kimi_helpers import k3_full_size_text


def test_k3_schedule_is_zero_based():
    config = KimiTextConfig.from_hf(k3_full_size_text(), tp_size=8)
    assert sorted(config.mla_layers) == list(range(3, 88, 4)) + [91, 92]
    assert len(config.kda_layers) == 69 and config.is_kda_layer(0)
    assert not config.is_moe_layer(0) and all(
        config.is_moe_layer(i) for i in range(1, 93)
    )
    assert config.blocks_before(47) == 4 and config.blocks_before(46) == 4
    assert config.blocks_before(93) == 8


def test_tiny_configs():
    k3 = KimiTextConfig.from_hf(k3_text_config())
    assert sorted(k3.kda_layers) == [0, 2, 4, 5]
    assert sorted(k3.mla_layers) == [1, 3, 6, 7]
    assert k3.gate_lower_bound == -5.0 and k3.uses_attn_res
    assert k3.kv_latent_dim == 48 and k3.mla_norm_eps == 1e-5
    kl = KimiTextConfig.from_hf(kimi_linear_config())
    assert not kl.uses_attn_res and kl.gate_lower_bound is None
    assert kl.q_lora_rank is None and kl.num_expert_group == 4


def with_lac(**changes) -> dict:
    text = copy.deepcopy(k3_text_config())
    text["linear_attn_config"].update(changes)
    return text


@pytest.mark.parametrize(
    "text, message",
    [
        (with_lac(kda_layers=[1, 2, 3, 5, 6]), r"\[2\] \(1-based\) are listed as both"),
        (with_lac(kda_layers=[1, 3, 5]), r"\[6\] \(1-based\) are in neither"),
        (with_lac(kda_layers=[0, 1, 3, 5, 6]), "outside the 1-based range"),
        (with_lac(gate_lower_bound=-6.0), "gate_lower_bound=-6.0 lies outside"),
        (with_lac(gate_lower_bound=0.0), "gate_lower_bound=0.0 lies outside"),
        ({**k3_text_config(), "mla_use_nope": False}, "mla_use_nope: false"),
        (
            {**k3_text_config(), "num_experts": 8, "n_routed_experts": 16},
            "num_experts=8 and n_routed_experts=16, two spellings",
        ),
    ],
)
def test_invalid_configs_are_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        KimiTextConfig.from_hf(text)


def test_lower_bound_edge_is_accepted():
    assert KimiTextConfig.from_hf(with_lac(gate_lower_bound=-5)).gate_lower_bound == -5


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"linear_attn_config": {"num_heads": 6}}, "linear_attn_config.num_heads=6"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6},
            "num_attention_heads=6",
        ),
        ({"intermediate_size": 258}, "intermediate_size=258"),
        ({"moe_intermediate_size": 66}, "moe_intermediate_size=66"),
        ({"vocab_size": 1022}, "vocab_size=1022"),
    ],
)
def test_tp_divisibility_names_the_field(changes, field):
    text = copy.deepcopy(k3_text_config())
    for key, value in changes.items():
        if isinstance(value, dict):
            text[key].update(value)
        else:
            text[key] = value
    with pytest.raises(
        ValueError, match=f"tensor_parallel_size=4 does not divide {field}"
    ):
        KimiTextConfig.from_hf(text, tp_size=4)


def test_aliases_fold_into_canonical_fields():
    text = k3_text_config()
    for alias, canonical in [
        ("n_routed_experts", "num_experts"),
        ("num_experts_per_tok", "num_experts_per_token"),
        ("n_shared_experts", "num_shared_experts"),
        ("norm_topk_prob", "moe_renormalize"),
        ("scoring_func", "moe_router_activation_func"),
        ("n_group", "num_expert_group"),
    ]:
        text[alias] = text.pop(canonical)
    text.update(n_routed_experts=16, n_group=4, topk_group=2, norm_topk_prob=False)
    config = KimiTextConfig.from_hf(text)
    assert (config.num_experts, config.num_expert_group) == (16, 4)
    assert config.num_experts_per_token == 2 and config.num_shared_experts == 2
    assert config.moe_renormalize is False and config.scoring == "sigmoid"
    text["use_grouped_topk"] = False
    assert KimiTextConfig.from_hf(text).num_expert_group == 1


def test_tensor_parallel_shard_shapes():
    config = Config(model="tiny-kimi-k3", tensor_parallel_size=2)
    with build_parallel_state(tp_rank=1, tp_size=2):
        model = KimiLinearModel(config)
    kda, mla = model.layers[0].self_attn, model.layers[1].self_attn
    # q, k, v slices, then f_a whole (K3's output gate is full-rank)
    assert tuple(kda.in_proj.weight.shape) == (3 * 64 + 32, 128)
    assert tuple(kda.q_conv1d.weight.shape) == (64, 1, 4)
    assert tuple(kda.A_log.shape) == (2,) and tuple(kda.b_proj.weight.shape) == (2, 128)
    assert [(t.name, t.shape, t.dtype) for t in kda.state_spec()] == [
        ("conv", (192, 3), None),
        ("ssm", (2, 32, 32), torch.float32),
    ]
    assert tuple(kda.o_proj.weight.shape) == (128, 64)
    assert tuple(mla.q_a_proj.weight.shape) == (64, 128)  # replicated
    assert tuple(mla.q_b_proj.weight.shape) == (96, 64)
    assert tuple(mla.kv_b_proj.weight.shape) == (128, 32)
    assert mla.kv_cache_dim == 48
    moe = model.layers[1].block_sparse_moe
    assert tuple(moe.experts.w13.shape) == (8, 64, 64)
    assert tuple(moe.experts.w2.shape) == (8, 64, 32)
    assert tuple(moe.routed_expert_down_proj.weight.shape) == (64, 128)
    assert tuple(model.embed_tokens.weight.shape) == (TINY_VOCAB_SIZE // 2, 128)
