"""Pipeline-parallel building blocks: partition, placement, embedding rule, PP checks."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from atom.config import Config
from atom.distributed.parallel_state import build_parallel_state
from atom.models import registry
from atom.models.registry import check_pp_support
from atom.models.utils import (
    IntermediateTensors,
    PPMissingLayer,
    get_pp_indices,
    is_pp_missing_parameter,
    make_layers,
    missing_layer_prefixes,
    pp_holds_embedding,
)


def write_config(folder, arch="KimiK3ForConditionalGeneration", layers=8):
    folder.mkdir(parents=True, exist_ok=True)
    text = {"num_hidden_layers": layers, "num_attention_heads": 4, "vocab_size": 1024}
    (folder / "config.json").write_text(
        json.dumps({"architectures": [arch], "text_config": text})
    )
    return str(folder)


@pytest.fixture
def target(tmp_path):
    return write_config(tmp_path / "target")


@pytest.fixture
def draft(tmp_path):
    return write_config(tmp_path / "draft", arch="K3DSparkModel", layers=2)


def make_config(target, draft=None, method=None, pp=1, kv_role="none", arch=None):
    if arch is not None:
        target = write_config(Path(target).parent / arch, arch)
    return Config(
        model=target,
        pipeline_parallel_size=pp,
        method=method,
        draft_model=draft if method else None,
        kv_role=kv_role,
    )


@pytest.mark.parametrize(
    "layers,stages",
    [(60, 8), (78, 8), (61, 4), (80, 3), (32, 1), (93, 8), (61, 2), (7, 7)],
)
def test_partition_is_contiguous_and_spares_the_last_stage(layers, stages):
    spans = [get_pp_indices(layers, r, stages) for r in range(stages)]
    assert spans[0][0] == 0 and spans[-1][1] == layers
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end == start
    sizes = [end - start for start, end in spans]
    assert min(sizes) >= 1
    assert sizes[-1] == layers // stages  # the remainder never lands on the last stage


def test_k3_partitions():
    def sizes(stages):
        return [
            e - s for s, e in (get_pp_indices(93, r, stages) for r in range(stages))
        ]

    assert sizes(2) == [47, 46]
    assert sizes(4) == [23, 23, 24, 23]
    assert sizes(8) == [11, 11, 12, 12, 12, 12, 12, 11]


def test_partition_override(target):
    assert get_pp_indices(8, 1, 2, partition=[3, 5]) == (3, 8)
    with pytest.raises(ValueError, match="sums to 7"):
        get_pp_indices(8, 0, 2, partition=[4, 3])
    with pytest.raises(ValueError, match="has 3 entries"):
        get_pp_indices(8, 0, 2, partition=[2, 3, 3])


def test_partition_from_the_environment_is_resolved_in_config(target, monkeypatch):
    for var in ("ATOM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION"):
        monkeypatch.delenv(var, raising=False)
    assert Config(model=target, pipeline_parallel_size=2).pp_layer_partition is None
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "5,3")
    config = Config(model=target, pipeline_parallel_size=2)
    assert config.pp_layer_partition == [5, 3]
    assert "pp layer partition [5, 3]" in config.describe_settings()
    monkeypatch.setenv("ATOM_PP_LAYER_PARTITION", "6,2")  # atom's name wins
    assert Config(model=target, pipeline_parallel_size=2).pp_layer_partition == [6, 2]
    given = Config(model=target, pipeline_parallel_size=2, pp_layer_partition=[3, 5])
    assert given.pp_layer_partition == [3, 5]  # the caller's value wins
    monkeypatch.setenv("ATOM_PP_LAYER_PARTITION", "4,3")
    with pytest.raises(ValueError, match="sums to 7"):
        Config(model=target, pipeline_parallel_size=2)


def test_limits_are_built_once(target):
    config = Config(model=target)
    assert config.limits is config.limits
    assert config.limits.max_num_seqs == config.max_num_seqs


def test_make_layers_builds_only_owned_layers():
    built = []

    def layer_fn(prefix):
        built.append(prefix)
        return nn.Linear(2, 2)

    with build_parallel_state(pp_rank=1, pp_size=2):
        start, end, layers = make_layers(8, layer_fn, "model.layers")
    assert (start, end) == (4, 8)
    assert built == [f"model.layers.{i}" for i in range(4, 8)]
    assert all(isinstance(layers[i], PPMissingLayer) for i in range(4))
    assert not list(layers[0].parameters())


def test_pp_missing_layer_passes_through():
    x, y = torch.ones(2), torch.zeros(2)
    assert PPMissingLayer()(x, y) is x
    assert PPMissingLayer()(hidden=y) is y
    assert PPMissingLayer(return_tuple=True)(x)[0] is x


def test_missing_prefixes_end_in_a_dot():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(1, 1), PPMissingLayer()])
    prefixes = missing_layer_prefixes(model)
    assert prefixes == ["layers.1."]
    assert is_pp_missing_parameter("layers.1.weight", prefixes)
    assert not is_pp_missing_parameter("layers.11.weight", prefixes)


def test_intermediate_tensors_slice_every_key():
    block = torch.arange(24.0).view(4, 2, 3)
    it = IntermediateTensors(
        {"hidden_states": torch.ones(4, 3), "block_residual": block}
    )
    half = it[1:3]
    assert half["block_residual"].shape == (2, 2, 3)
    assert set(half.keys()) == {"hidden_states", "block_residual"}


@pytest.mark.parametrize(
    "rank,size,method,producer,expected",
    [
        (0, 1, None, False, True),
        (0, 2, None, False, True),
        (1, 2, None, False, False),
        (0, 2, "dspark", False, True),
        (1, 2, "dspark", False, True),
        (1, 3, "dspark", False, False),
        (2, 3, "dspark", False, True),
        (1, 2, "dspark", True, False),
    ],
)
def test_pp_holds_embedding(target, draft, rank, size, method, producer, expected):
    config = make_config(
        target, draft, method, kv_role="kv_producer" if producer else "none"
    )
    with build_parallel_state(pp_rank=rank, pp_size=size):
        assert pp_holds_embedding(config) is expected


@pytest.mark.parametrize(
    "arch", ["KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration"]
)
def test_pp_support_accepts_dspark(target, draft, arch):
    check_pp_support(make_config(target, draft, "dspark", pp=2, arch=arch))


def test_pp_support_refuses_undeclared_methods(target, draft, monkeypatch):
    config = make_config(target, draft, "dspark", pp=2)
    monkeypatch.delitem(
        registry.pp_speculative_methods, "KimiK3ForConditionalGeneration"
    )
    with pytest.raises(ValueError, match="pp_speculative_methods") as err:
        check_pp_support(config)
    assert "'dspark'" in str(err.value)
    assert "KimiK3ForConditionalGeneration" in str(err.value)


def test_invalid_parallel_configs_name_the_field(target):
    with pytest.raises(ValueError, match="exceeds num_hidden_layers=8"):
        Config(model=target, pipeline_parallel_size=9)
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        Config(model=target, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        Config(model=target, method="medusa")
    with pytest.raises(ValueError, match="needs a draft model"):
        Config(model=target, method="dspark")
    with pytest.raises(ValueError, match="unknown kv_role"):
        Config(model=target, kv_role="producer")
    with pytest.raises(ValueError, match="'kv_consumer' .* needs --kv-transfer-config"):
        Config(model=target, kv_role="kv_consumer")
    with pytest.raises(ValueError, match="kv_connector 'nixl'; allowed: mooncake"):
        Config(model=target, kv_transfer_config='{"kv_role": "kv_consumer", '
               '"kv_connector": "nixl"}')  # fmt: skip
    with pytest.raises(ValueError, match="unknown keys handshake; allowed"):
        Config(model=target, kv_transfer_config={"kv_role": "kv_producer",
                                                 "handshake": 1})  # fmt: skip
    with pytest.raises(ValueError, match="not valid JSON"):
        Config(model=target, kv_transfer_config="{kv_role: kv_producer}")
    with pytest.raises(ValueError, match="contradicts kv_transfer_config's"):
        Config(model=target, kv_role="kv_producer",
               kv_transfer_config={"kv_role": "kv_consumer"})  # fmt: skip
    for method in ("eagle3", "mtp"):  # declared nowhere until a drafter exists
        with pytest.raises(ValueError, match=f"unknown speculative method '{method}'"):
            Config(model=target, method=method, draft_model=target)
