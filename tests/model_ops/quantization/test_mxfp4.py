"""MXFP4 routed experts: the e2m1/e8m0 codec and loading a K3-style MXFP4 checkpoint.

The codec is checked against hand-computed bytes (code table, low-nibble-first order,
e8m0 scales, ties-to-even, saturation). The checkpoint tests rebuild tiny-kimi-k3
with its routed experts stored as compressed-tensors `mxfp4-pack-quantized` and
compare against a plain checkpoint holding the dequantized weights: same weights,
so fp32 logits must be bit-identical, at tp=1 and tp=2, and tp-sliced loads must
equal slices of the full weight.
"""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atom.config import Config
from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import build_parallel_state, get_tp_group
from atom.model_loader.build import load_target
from atom.model_loader.loader import WeightLoadingError, load_weights
from atom.model_ops.quantization.mxfp4 import declares_mxfp4, dequantize_mxfp4
from atom.model_ops.routed_experts import FusedExperts
from atom.models.kimi.model import KimiK3ForConditionalGeneration
from atom.models.tiny import resolve_model_path
from tests.model_ops.quantization.mxfp4_reference import quantize_mxfp4
from tests.models.kimi_helpers import bind_caches, build_target, logits_of, work

# The shape of Kimi-K3's `text_config.quantization_config` (compressed-tensors).
K3_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "group_size": 32,
                "type": "float",
                "strategy": "group",
                "symmetric": True,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}
EXPERT_W1 = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
PROMPT = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3, 150]
SCALE_ONE = 127  # e8m0 byte of 2^0


def dequant(packed: list[list[int]], scale: list[list[int]]) -> torch.Tensor:
    return dequantize_mxfp4(
        torch.tensor(packed, dtype=torch.uint8),
        torch.tensor(scale, dtype=torch.uint8),
        torch.float32,
    )


# --- the codec -------------------------------------------------------------------


def test_code_table_and_low_nibble_first():
    # Row 0: byte k holds code k in the low nibble; row 1 in the high nibble.
    out = dequant([list(range(16)), [k << 4 for k in range(16)]], [[SCALE_ONE]] * 2)
    expected = torch.tensor(E2M1)
    assert torch.equal(out[0, 0::2], expected) and not out[0, 1::2].any()
    assert torch.equal(out[1, 1::2], expected) and not out[1, 0::2].any()
    assert torch.signbit(out[0, 16]) and not torch.signbit(out[0, 0])  # code 8: -0
    # Hand-decoded bytes: 0x71 = (+6.0 high, +0.5 low); 0x2F = (+1.0, -6.0);
    # 0x98 = (-0.5, -0.0); 0x4B = (+2.0, -1.5).
    row = dequant([[0x71, 0x2F, 0x98, 0x4B] + [0] * 12], [[SCALE_ONE]])[0, :8]
    assert row.tolist() == [0.5, 6.0, -6.0, 1.0, -0.0, -0.5, -1.5, 2.0]


def test_e8m0_scale_is_a_biased_power_of_two():
    bytes_one = [[0x22] * 16]  # every element 1.0
    for byte, value in [(0, 2.0**-127), (126, 0.5), (128, 2.0), (254, 2.0**127)]:
        out = dequant(bytes_one, [[byte]])
        assert torch.equal(out, torch.full((1, 32), value)), byte
    # Two blocks of one row take their own scales: 32 inputs per scale byte.
    out = dequant([[0x22] * 32], [[SCALE_ONE, 130]])
    assert out[0, :32].unique().tolist() == [1.0]
    assert out[0, 32:].unique().tolist() == [8.0]
    with pytest.raises(ValueError, match="NaN"):
        dequant(bytes_one, [[0xFF]])


def test_bad_packed_or_scale_is_refused():
    with pytest.raises(ValueError, match="weight_scale"):
        dequant([[0] * 16], [[SCALE_ONE, SCALE_ONE]])
    with pytest.raises(ValueError, match="multiple of the block"):
        dequant([[0] * 8], [[SCALE_ONE]])
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(torch.zeros(1, 16), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48))


def test_quantize_hand_computed_bytes():
    block = torch.zeros(32)
    block[:4] = torch.tensor([6.0, -0.5, 3.0, 0.25])
    packed, scale = quantize_mxfp4(torch.stack([block, block * 32]))
    # 6 -> code 7, -0.5 -> 9: 0x97; 3 -> 5, 0.25 (tie) -> 0: 0x05. amax 6 and 192
    # give X = 2^(floor(log2 amax) - 2) = 2^0 and 2^5.
    assert packed[:, :2].tolist() == [[0x97, 0x05], [0x97, 0x05]]
    assert scale.tolist() == [[127], [132]]


def test_quantize_rounds_ties_to_even_and_saturates():
    block = torch.zeros(32)
    block[:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    packed, scale = quantize_mxfp4(block[None])
    assert scale.tolist() == [[127]]  # amax 7: X = 1, and 7 saturates to 6
    out = dequantize_mxfp4(packed, scale, torch.float32)
    assert out[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_round_trip_is_exact_on_the_grid():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 128), generator=g)
    powers = torch.randint(-8, 9, (8, 4, 1), generator=g).float().exp2()
    weight = (torch.tensor(E2M1)[codes].view(8, 4, 32) * powers).view(8, 128)
    packed, scale = quantize_mxfp4(weight)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (8, 64) and scale.shape == (8, 4)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), weight)
    assert torch.equal(dequantize_mxfp4(packed, scale), weight.bfloat16())
    # Any stored bytes decode to values that quantize back to themselves.
    stored = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (8, 4), dtype=torch.uint8, generator=g)
    decoded = dequantize_mxfp4(stored, scales, torch.float32)
    again = dequantize_mxfp4(*quantize_mxfp4(decoded), torch.float32)
    assert torch.equal(again, decoded)


def test_quantization_config_declaration():
    assert declares_mxfp4(K3_QUANTIZATION, EXPERT_W1)
    attention = "language_model.model.layers.3.self_attn.q_a_proj"
    shared = "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj"
    assert not declares_mxfp4(K3_QUANTIZATION, attention)
    assert not declares_mxfp4(K3_QUANTIZATION, shared)
    assert not declares_mxfp4(None, EXPERT_W1)
    assert declares_mxfp4({"format": "mxfp4-pack-quantized"}, EXPERT_W1)
    assert not declares_mxfp4({"quant_method": "fp8", "format": "x"}, EXPERT_W1)
    nvfp4 = copy.deepcopy(K3_QUANTIZATION)
    nvfp4["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    nvfp4["format"] = "nvfp4-pack-quantized"
    assert not declares_mxfp4(nvfp4, EXPERT_W1)
    wrong = copy.deepcopy(K3_QUANTIZATION)
    wrong["config_groups"]["group_0"]["weights"]["group_size"] = 16
    with pytest.raises(ValueError, match="group_size"):
        declares_mxfp4(wrong, EXPERT_W1)


# --- MXFP4 tiny-kimi-k3 checkpoints --------------------------------------------


def read_tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def is_expert_weight(name: str) -> bool:
    return ".block_sparse_moe.experts." in name and name.endswith(".weight")


def write_checkpoint(
    folder: Path, tensors: dict[str, torch.Tensor], quantization: dict | None
) -> str:
    """tiny-kimi-k3's config + tokenizer with `tensors` in two shards; every
    `.weight_scale` lands in the first shard, so it arrives before its partner."""
    source = resolve_model_path("tiny-kimi-k3")
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("model*"))
    config = json.loads((folder / "config.json").read_text())
    if quantization is not None:
        config["text_config"]["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    first = {k: v for k, v in tensors.items() if k.endswith(".weight_scale")}
    shards = {"model-00001-of-00002.safetensors": first}
    shards["model-00002-of-00002.safetensors"] = {
        k: v for k, v in tensors.items() if k not in first
    }
    weight_map = {}
    for file_name, part in shards.items():
        save_file(part, str(folder / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(folder)


@pytest.fixture(scope="module")
def k3_tensors():
    """(MXFP4 tensors, plain tensors holding their dequantized experts)."""
    packed_form, plain = {}, {}
    for name, tensor in read_tensors(resolve_model_path("tiny-kimi-k3")).items():
        if not is_expert_weight(name):
            packed_form[name] = plain[name] = tensor
            continue
        packed, scale = quantize_mxfp4(tensor)
        packed_form[name + "_packed"], packed_form[name + "_scale"] = packed, scale
        plain[name] = dequantize_mxfp4(packed, scale, tensor.dtype)
    return packed_form, plain


@pytest.fixture(scope="module")
def folders(k3_tensors, tmp_path_factory):
    packed_form, plain = k3_tensors
    root = tmp_path_factory.mktemp("mxfp4")
    return {
        "mxfp4": write_checkpoint(root / "mxfp4", packed_form, K3_QUANTIZATION),
        "plain": write_checkpoint(root / "plain", plain, None),
    }


def prompt_logits(model) -> torch.Tensor:
    bind_caches(model)
    return logits_of(model, [work(PROMPT)])


def expert_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".experts.w" in n}


def test_mxfp4_checkpoint_gives_the_plain_checkpoints_logits(folders, k3_tensors):
    _, plain = k3_tensors
    original = read_tensors(resolve_model_path("tiny-kimi-k3"))
    name = EXPERT_W1 + ".weight"
    assert not torch.equal(plain[name], original[name])  # quantization was real
    quantized, _ = build_target(folders["mxfp4"])
    reference, _ = build_target(folders["plain"])
    loaded = expert_params(quantized)
    w13 = loaded["language_model.model.layers.1.block_sparse_moe.experts.w13"]
    assert torch.equal(w13[0, :64], plain[name])
    for key, param in expert_params(reference).items():
        assert torch.equal(loaded[key], param), key
    assert torch.equal(prompt_logits(quantized), prompt_logits(reference))


def test_online_ptpc_fp8_keeps_declared_mxfp4_experts_in_the_checkpoints_form(
    folders,
):
    online = '{"global_quant_config": "ptpc_fp8"}'
    config = Config(model=folders["mxfp4"], device="cpu", online_quant_config=online)
    model, _ = load_target(config, "cpu")
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.w13.dtype == torch.float32 for m in experts)
    assert not any(hasattr(m, "w13_scale") for m in experts)
    dense = model.get_submodule("language_model.model.layers.0.mlp.down_proj")
    assert dense.weight.dtype == torch.float8_e4m3fn


def test_packed_names_load_without_a_quantization_config(k3_tensors, tmp_path):
    packed_form, plain = k3_tensors
    model, _ = build_target(write_checkpoint(tmp_path / "m", packed_form, None))
    w2 = expert_params(model)[
        "language_model.model.layers.5.block_sparse_moe.experts.w2"
    ]
    name = "language_model.model.layers.5.block_sparse_moe.experts.7.w2.weight"
    assert torch.equal(w2[7], plain[name])


def test_missing_scale_is_refused_by_name(k3_tensors, tmp_path):
    packed_form, _ = k3_tensors
    tensors = dict(packed_form)
    del tensors[EXPERT_W1 + ".weight_scale"]
    folder = write_checkpoint(tmp_path / "m", tensors, K3_QUANTIZATION)
    with pytest.raises(WeightLoadingError) as err:
        build_target(folder)
    message = str(err.value)
    assert "layers.1.block_sparse_moe.experts.w13" in message
    assert "experts.0.w1.weight_scale" in message
    assert "weight_packed" not in message


def test_declared_mxfp4_projection_missing_entirely_names_both_halves(
    k3_tensors, tmp_path
):
    packed_form, _ = k3_tensors
    stem = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight"
    tensors = {k: v for k, v in packed_form.items() if not k.startswith(stem)}
    folder = write_checkpoint(tmp_path / "m", tensors, K3_QUANTIZATION)
    with pytest.raises(WeightLoadingError) as err:
        build_target(folder)
    assert "experts.3.w2.weight_packed" in str(err.value)
    assert "experts.3.w2.weight_scale" in str(err.value)


def test_plain_and_mxfp4_forms_of_one_projection_are_refused(k3_tensors, tmp_path):
    packed_form, plain = k3_tensors
    tensors = dict(packed_form)
    tensors[EXPERT_W1 + ".weight"] = plain[EXPERT_W1 + ".weight"]
    folder = write_checkpoint(tmp_path / "m", tensors, K3_QUANTIZATION)
    with pytest.raises(WeightLoadingError, match="both as a plain weight and as MXFP4"):
        build_target(folder)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_sliced_load_equals_the_full_weights_slice(folders, tp_size):
    # At tp=4 each rank's w2 input slice is 16 wide: half an MXFP4 scale block.
    full, _ = build_target(folders["plain"])
    full_params = expert_params(full)
    config = Config(model=folders["mxfp4"], tensor_parallel_size=tp_size)
    for rank in range(tp_size):
        with build_parallel_state(tp_rank=rank, tp_size=tp_size):
            model = KimiK3ForConditionalGeneration(config)
            load_weights(model, config.model)
        for key, param in expert_params(model).items():
            whole = full_params[key]
            if key.endswith(".w2"):
                want = whole.chunk(tp_size, dim=2)[rank]
            else:
                gate, up = whole.chunk(2, dim=1)
                pick = [t.chunk(tp_size, dim=1)[rank] for t in (gate, up)]
                want = torch.cat(pick, dim=1)
            assert torch.equal(param, want), (key, rank)


def tp_rank_logits(rank: int, folders: dict[str, str]) -> dict[str, torch.Tensor]:
    tp = get_tp_group().world_size
    out = {}
    for kind, folder in folders.items():
        model, _ = build_target(folder, tensor_parallel_size=tp)
        out[kind] = prompt_logits(model)
    return out


@pytest.mark.slow
def test_tp2_mxfp4_logits_equal_plain_logits(folders):
    reference, _ = build_target(folders["plain"])
    expected = prompt_logits(reference)
    for ranks in run_ranks(tp_rank_logits, tp_size=2, args=(folders,)):
        assert torch.equal(ranks["mxfp4"], ranks["plain"])
        torch.testing.assert_close(ranks["mxfp4"], expected, atol=1e-4, rtol=1e-4)
