"""The layer plan: attention and FFN kind per layer, AttnRes blocks, the layers drafts tap.

Checked for the released Kimi-K3 schedule, for K3.1 (served by the K3 code through
ARCH_ALIASES, so its plan must come out of the same reader unchanged), and for every
tiny layout the tests run.
"""

import json

import pytest

from atom.config import Config
from atom.models.kimi.config import KimiTextConfig
from atom.models.kimi.dspark_config import DSparkDraftConfig
from atom.models.kimi.model import text_config_of
from atom.models.kimi.plan import FFN, Attention
from atom.models.tiny.configs import dspark_config, k3_text_config
from tests.models.kimi_helpers import k3_full_size_text

# Published draft taps (0-based target_layer_ids): Inferact/Kimi-K3-DSpark, and the
# other K3-family set that appears without a confirmed checkpoint.
K3_DSPARK_TAPS = [2, 23, 47, 71, 89]
K3_FAMILY_ALT_TAPS = [7, 31, 47, 63, 87]

# K K K M x 23, then M; layer 0 dense, every later layer MoE.
RELEASED_K3_PATTERN = " ".join(
    ["Kd", "Ke", "Ke", "Me"] + ["Ke", "Ke", "Ke", "Me"] * 22 + ["Me"]
)


def pattern(plan) -> str:
    """Two letters per layer: K/M for KDA/MLA, then d/e for dense/MoE."""
    return " ".join(
        ("K" if layer.is_kda else "M") + ("e" if layer.is_moe else "d")
        for layer in plan
    )


def block_starts(plan) -> tuple[int, ...]:
    """Layers that bank the running block (AttnRes boundaries)."""
    return tuple(layer.index for layer in plan if layer.opens_block)


def k3_folder(tmp_path, architecture: str) -> str:
    folder = tmp_path / architecture
    folder.mkdir()
    config = {"architectures": [architecture], "text_config": k3_full_size_text()}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def k3_plan():
    return KimiTextConfig.from_hf(k3_full_size_text(), tp_size=8).plan


def test_released_k3_schedule(k3_plan):
    assert k3_plan.num_layers == 93
    assert pattern(k3_plan) == RELEASED_K3_PATTERN
    assert sorted(k3_plan.mla_layers) == list(range(3, 88, 4)) + [91, 92]
    assert len(k3_plan.kda_layers) == 69
    # Layer 0 is KDA + dense; every later layer is MoE.
    assert k3_plan[0].attention is Attention.KDA and k3_plan[0].ffn is FFN.DENSE
    assert k3_plan.moe_layers == frozenset(range(1, 93))


def test_released_k3_attn_res_blocks(k3_plan):
    assert k3_plan.attn_res_block_size == 12
    assert block_starts(k3_plan) == tuple(range(0, 93, 12))
    assert [k3_plan[i].blocks_before for i in (0, 1, 12, 13, 46, 47, 92)] == [
        0,
        1,
        1,
        2,
        4,
        4,
        8,
    ]
    # The final mix reads 8 closed blocks plus the running one: 9 candidates.
    assert k3_plan.blocks_before(93) == 8
    # A PP split at 46 or 47 receives a bank of 4 blocks.
    assert k3_plan.blocks_before(46) == k3_plan.blocks_before(47) == 4


def test_k3_dspark_taps(k3_plan):
    plan = k3_plan
    kinds = [(plan[i].attention, plan[i].ffn) for i in K3_DSPARK_TAPS]
    assert [a for a, _ in kinds] == [
        Attention.KDA,
        Attention.MLA,
        Attention.MLA,
        Attention.MLA,
        Attention.KDA,
    ]
    assert all(ffn is FFN.MOE for _, ffn in kinds)
    # Tap 23 is the last layer of AttnRes block 1 (layers 12..23).
    assert plan[23].blocks_before == 2 and plan[24].opens_block
    assert all(plan[i].attention is Attention.MLA for i in K3_FAMILY_ALT_TAPS)


def test_k31_plan_is_k3s(tmp_path, k3_plan):
    """K3.1 resolves to the K3 class and reads the same text config to the same plan."""
    for architecture in (
        "KimiK3ForConditionalGeneration",
        "KimiK31ForConditionalGeneration",
    ):
        config = Config(model=k3_folder(tmp_path, architecture), max_model_len=64)
        assert text_config_of(config).plan == k3_plan


# Tiny layouts: (model, per-layer pattern, AttnRes block starts, final-mix blocks).
TINY_LAYOUTS = [
    ("tiny-kimi-linear", "Kd Me Ke Me", (), 0),
    ("tiny-kimi-k3", "Kd Me Ke Me Ke Ke Me Me", (0, 2, 4, 6), 4),
    ("tiny-kimi-k31", "Kd Me Ke Me Ke Ke Me Me", (0, 2, 4, 6), 4),
]


@pytest.mark.parametrize("model, layers, starts, final_blocks", TINY_LAYOUTS)
def test_tiny_layout_plans(model, layers, starts, final_blocks):
    plan = text_config_of(Config(model=model)).plan
    assert pattern(plan) == layers
    assert block_starts(plan) == starts
    assert plan.blocks_before(plan.num_layers) == final_blocks
    assert plan.uses_attn_res == bool(starts)


def test_tiny_dspark_taps():
    target = k3_text_config()
    draft = DSparkDraftConfig.from_hf(dspark_config(target))
    plan = KimiTextConfig.from_hf(target).plan
    assert draft.target_layer_ids == (-1, 1, 4, 6)  # -1: the embedding output
    tapped_layers = (1, 4, 6)
    assert [plan[i].attention for i in tapped_layers] == [
        Attention.MLA,
        Attention.KDA,
        Attention.MLA,
    ]
    # Taps 1 and 4 sit on either side of a block boundary (blocks open at 2 and 4).
    assert [plan[i].blocks_before for i in tapped_layers] == [1, 2, 3]


def test_layers_are_built_from_the_plan():
    """The decoder layers follow the plan, AttnRes boundaries included."""
    from atom.models.kimi.model import KimiLinearModel

    config = Config(model="tiny-kimi-k3")
    model = KimiLinearModel(config)
    plan = model.text_config.plan
    for layer, layer_plan in zip(model.layers, plan):
        is_kda = type(layer.self_attn).__name__ == "KimiDeltaAttention"
        assert is_kda == layer_plan.is_kda
        assert hasattr(layer, "block_sparse_moe") == layer_plan.is_moe
        assert layer.opens_block == layer_plan.opens_block
