"""atom reads a Kimi config.json as transformers' `KimiLinearConfig` does.

Each case builds a `KimiLinearConfig` from a minimal keyword set, lets transformers
write it (`save_pretrained`), and compares atom's reading with the attribute values
transformers itself holds, field by field. The checkpoint (K3 `text_config`) dialect
goes through the same reader; two spellings of one fact that disagree are an error
naming both.
"""

import copy
import dataclasses
import json

import pytest

from atom.models.kimi.config import KimiTextConfig
from atom.models.tiny.configs import k3_text_config, kimi_linear_config
from tests.models.kimi_helpers import (
    TRANSFORMERS_MLA_FIRST_ALL_MOE,
    TRANSFORMERS_TINY_KDA_WIDTHS,
    TRANSFORMERS_TINY_WIDTHS,
)

transformers = pytest.importorskip("transformers")

CASES = {
    "all_defaults": {},
    "default_schedule": dict(
        TRANSFORMERS_TINY_WIDTHS,
        num_hidden_layers=9,
        linear_attn_config=TRANSFORMERS_TINY_KDA_WIDTHS,
    ),
    "layer_lists_all_moe": dict(
        TRANSFORMERS_TINY_WIDTHS, **TRANSFORMERS_MLA_FIRST_ALL_MOE
    ),
    "explicit_types": dict(
        TRANSFORMERS_TINY_WIDTHS,
        num_hidden_layers=4,
        layer_types=[
            "linear_attention",
            "linear_attention",
            "full_attention",
            "full_attention",
        ],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        linear_num_heads=2,
        linear_head_dim=32,
        linear_conv_kernel_dim=3,
    ),
    "other_spellings": dict(
        TRANSFORMERS_TINY_WIDTHS,
        num_hidden_layers=3,
        linear_attn_config={
            **TRANSFORMERS_TINY_KDA_WIDTHS,
            "short_conv_kernel_size": 2,
        },
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        first_k_dense_replace=2,
    ),
}

ATTENTION = {"linear_attention": "kda", "full_attention": "mla"}
FFN = {"dense": "dense", "sparse": "moe"}


def saved_by_transformers(tmp_path, **kwargs) -> dict:
    transformers.KimiLinearConfig(**kwargs).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_fields_match_transformers(case, tmp_path):
    reference = transformers.KimiLinearConfig(**CASES[case])
    config = KimiTextConfig.from_hf(saved_by_transformers(tmp_path, **CASES[case]))
    same_name = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "rms_norm_eps",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "hidden_act",
        "moe_intermediate_size",
        "topk_group",
        "routed_scaling_factor",
    )
    for name in same_name:
        assert getattr(config, name) == getattr(reference, name), name
    renamed = {
        "kda_heads": "linear_num_heads",
        "kda_head_dim": "linear_head_dim",
        "conv_kernel_size": "linear_conv_kernel_dim",
        "num_experts": "num_local_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "num_shared_experts": "n_shared_experts",
        "num_expert_group": "n_group",
        "moe_renormalize": "norm_topk_prob",
    }
    for ours, theirs in renamed.items():
        assert getattr(config, ours) == getattr(reference, theirs), ours
    plan = config.plan
    assert [layer.attention.value for layer in plan] == [
        ATTENTION[t] for t in reference.layer_types
    ]
    assert [layer.ffn.value for layer in plan] == [
        FFN[t] for t in reference.mlp_layer_types
    ]
    # What transformers' KimiLinear model pins or lacks.
    assert config.mla_norm_eps == 1e-6 and not config.uses_attn_res
    assert config.gate_lower_bound is None and not config.use_full_rank_gate
    assert not config.mla_use_output_gate and config.scoring == "sigmoid"


def test_k3_text_config_resaved_by_transformers_reads_the_same(tmp_path):
    """transformers keeps K3's fields it does not know; the plan and every field
    (the checkpoint-dialect MLA norm eps included) stay as read from the original."""
    text = k3_text_config()
    resaved = saved_by_transformers(tmp_path, **text)
    assert "layer_types" in resaved and "mlp_layer_types" in resaved
    assert KimiTextConfig.from_hf(resaved) == KimiTextConfig.from_hf(text)


def test_absent_fields_take_transformers_defaults():
    text = kimi_linear_config()
    for name in (
        "num_shared_experts",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "moe_layer_freq",
    ):
        text.pop(name, None)
    text["linear_attn_config"] = {"num_heads": 4, "head_dim": 32}
    text["num_hidden_layers"] = 6
    config = KimiTextConfig.from_hf(text)
    assert config.num_shared_experts == 1 and config.routed_scaling_factor == 2.446
    assert config.conv_kernel_size == 4
    # No schedule at all: MLA at every fourth layer after layer 0, layer 0 dense.
    plan = config.plan
    assert plan.num_layers == 6 and plan.mla_layers == {4}
    assert plan.moe_layers == {1, 2, 3, 4, 5}


def with_changes(base: dict, **changes) -> dict:
    text = copy.deepcopy(base)
    for name, value in changes.items():
        if name == "linear_attn_config":
            text[name].update(value)
        else:
            text[name] = value
    return text


KL = kimi_linear_config()  # kda [1, 3], full [2, 4], first_k_dense_replace 1


@pytest.mark.parametrize(
    "text, names",
    [
        (
            with_changes(KL, layer_types=["linear_attention"] * 4),
            ("layer_types", "linear_attn_config.kda_layers", "[1, 3]"),
        ),
        (
            with_changes(KL, mlp_layer_types=["sparse"] * 4),
            ("mlp_layer_types", "first_k_dense_replace=1", "[0]"),
        ),
        (
            with_changes(
                KL, moe_layer_freq=2, mlp_layer_types=["dense"] + ["sparse"] * 3
            ),
            ("mlp_layer_types", "moe_layer_freq=2", "[1, 3]"),
        ),
        (
            with_changes(KL, linear_num_heads=8),
            ("linear_num_heads=8", "linear_attn_config.num_heads=4"),
        ),
        (
            with_changes(KL, linear_conv_kernel_dim=2),
            ("linear_conv_kernel_dim=2", "short_conv_kernel_size=4"),
        ),
        (
            with_changes(KL, num_local_experts=16),
            ("num_experts=8", "num_local_experts=16"),
        ),
        (
            with_changes(KL, num_experts_per_tok=4),
            ("num_experts_per_token=2", "num_experts_per_tok=4"),
        ),
    ],
)
def test_disagreeing_spellings_name_both(text, names):
    with pytest.raises(ValueError) as error:
        KimiTextConfig.from_hf(text)
    for name in names:
        assert name in str(error.value)


def test_agreeing_spellings_are_accepted():
    text = with_changes(
        KL,
        layer_types=["linear_attention", "full_attention"] * 2,
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_num_heads=4,
        num_local_experts=8,
    )
    both, checkpoint = KimiTextConfig.from_hf(text), KimiTextConfig.from_hf(KL)
    # Written by transformers now, so its q_a/kv_a norm eps is transformers'.
    assert (both.mla_norm_eps, checkpoint.mla_norm_eps) == (1e-6, 1e-5)
    assert both == dataclasses.replace(checkpoint, mla_norm_eps=1e-6)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"layer_types": ["linear_attention"] * 3}, "must list 4 entries"),
        ({"layer_types": ["mamba"] * 4}, "layer_types holds ['mamba']"),
        ({"mlp_layer_types": ["moe"] * 4}, "allowed: dense, sparse"),
        ({"linear_attn_config": {"kda_layers": None}}, "must be a list"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal"),
        ({"attention_bias": True}, "attention_bias: true"),
        (
            {
                "layer_types": ["linear_attention", "full_attention"] * 2,
                "hidden_act": "gelu",
            },
            "KDA short conv",
        ),
    ],
)
def test_unsupported_or_malformed_fields(changes, message):
    with pytest.raises(ValueError) as error:
        KimiTextConfig.from_hf(with_changes(KL, **changes))
    assert message in str(error.value)
