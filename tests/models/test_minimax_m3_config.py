"""MiniMax-M3 config dialects, registry entries and embedding placement under PP.

No processes: placement uses structural parallel groups (`build_parallel_state`).
"""

import copy
import json
import shutil

import pytest
import torch

from atom.config import Config
from atom.distributed.parallel_state import build_parallel_state
from atom.model_loader.build import building_on
from atom.model_loader.loader import load_weights
from atom.model_ops.embed_head import VocabParallelEmbedding
from atom.models import registry
from atom.models.minimax_m3.config import MiniMaxM3TextConfig
from atom.models.minimax_m3.model import (
    MiniMaxM3Model,
    MiniMaxM3SparseForConditionalGeneration,
)
from atom.models.tiny import resolve_model_path
from atom.models.tiny.configs import TINY_VOCAB_SIZE
from atom.models.tiny.minimax_specs import minimax_text_config
from atom.models.utils import PPMissingLayer, get_pp_indices
from atom.spec_decode.pp_aux_relay import PPAuxRelay
from tests.models.kimi_helpers import EMBEDDING_PLACEMENTS

TARGET, DRAFT = "tiny-minimax-m3", "tiny-minimax-m3-dspark"


def transformers_dialect(released: dict) -> dict:
    """What transformers' MiniMaxM3VLTextConfig writes for `released`."""
    text = {k: v for k, v in released.items() if k != "sparse_attention_config"}
    sparse = released["sparse_attention_config"]
    text.pop("moe_layer_freq")
    text.pop("rope_theta")
    text.pop("partial_rotary_factor")
    text["hidden_act"] = "silu"
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": released["rope_theta"],
        "partial_rotary_factor": released["partial_rotary_factor"],
    }
    text["layer_types"] = [
        "minimax_m3_sparse" if s else "full_attention"
        for s in sparse["sparse_attention_freq"]
    ]
    text["mlp_layer_types"] = [
        "sparse" if m else "dense" for m in released["moe_layer_freq"]
    ]
    text.update(
        index_n_heads=sparse["sparse_num_index_heads"],
        index_head_dim=sparse["sparse_index_dim"],
        index_block_size=sparse["sparse_block_size"],
        index_topk_blocks=sparse["sparse_topk_blocks"],
        index_local_blocks=sparse["sparse_local_block"],
    )
    return text


def test_both_dialects_give_one_plan():
    released = minimax_text_config()
    plan = MiniMaxM3TextConfig.from_hf(released)
    assert plan == MiniMaxM3TextConfig.from_hf(transformers_dialect(released))
    assert [(x.sparse_attention, x.moe) for x in plan.layers] == [
        (False, False), (False, False), (True, True), (True, True), (True, True),
        (True, True),
    ]  # fmt: skip
    assert plan.rotary_dim == 8 and plan.rope_theta == 5e6
    assert plan.indexer.block_size == 4 and plan.indexer.topk_blocks == 2
    assert plan.shared_intermediate_size == 32


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update(layer_types=["full_attention"] * 6), "disagree"),
        (lambda t: t.pop("sparse_attention_config"), "sparse_attention_freq"),
        (lambda t: t.update(hidden_act="gelu"), "swigluoai"),
        (lambda t: t.update(use_index_cache=True), "use_index_cache"),
        (lambda t: t.update(num_key_value_heads=4), "index_n_heads"),
        (lambda t: t.update(rotary_dim=6), "partial_rotary_factor"),
        (lambda t: t["sparse_attention_config"].update(sparse_score_type="sum"), "max"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(edit, message):
    text = copy.deepcopy(minimax_text_config())
    edit(text)
    with pytest.raises(ValueError, match=message):
        MiniMaxM3TextConfig.from_hf(text)


def test_tp_must_split_or_replicate_kv_heads():
    MiniMaxM3TextConfig.from_hf(minimax_text_config(), tp_size=4)  # replicates 2
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        MiniMaxM3TextConfig.from_hf(minimax_text_config(), tp_size=3)


def test_index_tensors_on_a_dense_plan_are_refused(tmp_path):
    """A config read as dense (here: sparse attention switched off) must not
    silently drop the checkpoint's indexer."""
    folder = tmp_path / "dense"
    shutil.copytree(resolve_model_path(TARGET), folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["sparse_attention_config"]["use_sparse_attention"] = False
    (folder / "config.json").write_text(json.dumps(config))
    model = MiniMaxM3SparseForConditionalGeneration(Config(model=str(folder)))
    with pytest.raises(ValueError, match="lightning indexer"):
        load_weights(model, str(folder))


def test_registry_serves_minimax_and_its_m31_alias(tmp_path, monkeypatch):
    alias = registry.resolve_architecture("MiniMaxM31SparseForConditionalGeneration")
    assert alias == "MiniMaxM3SparseForConditionalGeneration"
    assert registry.get_model_class(
        "MiniMaxM31SparseForConditionalGeneration"
    ) is registry.get_model_class(alias)
    families = {path.split(":")[0] for path in registry.TARGET_MODELS.values()}
    assert len(families) == 2  # Kimi and MiniMax
    pp_config = Config(
        model=TARGET, method="dspark", draft_model=DRAFT, pipeline_parallel_size=2
    )
    assert registry.serves_pp_speculation(pp_config)
    registry.check_pp_support(pp_config)
    m31 = tmp_path / "m31"
    shutil.copytree(resolve_model_path(TARGET), m31)
    config = json.loads((m31 / "config.json").read_text())
    config["architectures"] = ["MiniMaxM31SparseForConditionalGeneration"]
    (m31 / "config.json").write_text(json.dumps(config))
    registry.check_pp_support(
        Config(
            model=str(m31), method="dspark", draft_model=DRAFT, pipeline_parallel_size=2
        )
    )
    monkeypatch.delitem(
        registry.pp_speculative_methods, "MiniMaxM3SparseForConditionalGeneration"
    )
    with pytest.raises(ValueError, match="pp_speculative_methods") as err:
        registry.check_pp_support(pp_config)
    assert "MiniMaxM3SparseForConditionalGeneration" in str(err.value)


@pytest.mark.parametrize(
    "pp_rank, pp_size, method, kv_role, real", EMBEDDING_PLACEMENTS
)
def test_embedding_placement(pp_rank, pp_size, method, kv_role, real):
    config = Config(
        model=TARGET,
        pipeline_parallel_size=pp_size,
        method=method,
        draft_model=DRAFT if method else None,
        kv_role=kv_role,
    )
    with build_parallel_state(pp_rank=pp_rank, pp_size=pp_size):
        model = MiniMaxM3Model(config)
    embed = model.embed_tokens
    if real:
        assert isinstance(embed, VocabParallelEmbedding)
        assert tuple(embed.weight.shape) == (TINY_VOCAB_SIZE, 64)
    else:
        assert isinstance(embed, PPMissingLayer)
    assert model.vocab_size == TINY_VOCAB_SIZE  # on every stage, for share_with_target
    assert isinstance(model.norm, PPMissingLayer) is (pp_rank != pp_size - 1)
    owned = [i for i, m in enumerate(model.layers) if not isinstance(m, PPMissingLayer)]
    assert owned == list(range(model.start_layer, model.end_layer))


def test_router_stays_fp32_in_a_bf16_model():
    with building_on("cpu", torch.bfloat16):
        model = MiniMaxM3Model(Config(model=TARGET))
    moe = model.layers[2].block_sparse_moe
    assert moe.gate.weight.dtype == torch.float32
    assert moe.experts.w13.dtype == torch.bfloat16


class _TapLayer(torch.nn.Module):
    def aux_hidden_state(self, output):
        return output


@pytest.mark.parametrize(
    "pp, expected",
    [
        (2, [([1, 12, 23], [], [1, 12, 23]), ([35, 46, 57], [1, 12, 23], [])]),
        (
            4,
            [
                ([1, 12], [], [1, 12]),
                ([23], [1, 12], [1, 12, 23]),
                ([35], [1, 12, 23], [1, 12, 23, 35]),
                ([46, 57], [1, 12, 23, 35], []),
            ],
        ),
    ],
)
def test_real_minimax_tap_relay_per_stage(pp, expected):
    """docs/pp_dspark.md's stage table: MiniMax-M3's 60 layers and the draft's taps
    [1, 12, 23, 35, 46, 57], as the relay derives (own, incoming, outgoing)."""
    taps = [1, 12, 23, 35, 46, 57]
    for stage, want in enumerate(expected):
        start, end = get_pp_indices(60, stage, pp)
        base = torch.nn.Module()
        base.layers = torch.nn.ModuleList(
            _TapLayer() if start <= i < end else PPMissingLayer() for i in range(60)
        )
        relay = PPAuxRelay(base, taps, hidden_size=8, max_num_tokens=1)
        assert (relay.own, relay.incoming, relay.outgoing) == want
