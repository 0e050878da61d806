"""ptpc_fp8: the per-row e4m3 codec, the fp8 linear and expert products, TP shards'
own scales, and the online config's parsing and refusals."""

import pytest
import torch
import torch.nn.functional as F

from atom.config import Config
from atom.distributed.parallel_state import build_parallel_state
from atom.model_ops.activation import get_act_and_mul
from atom.model_ops.grouped_experts import ExpertChoice, grouped_expert_mlp
from atom.model_ops.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from atom.model_ops.quantization.config import QuantizationConfig
from atom.model_ops.quantization.ptpc_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    PtpcFp8Experts,
    PtpcFp8Linear,
    dequantize_rows,
    fp8_linear,
    quantize_rows,
    round_trip_rows,
)
from atom.model_ops.routed_experts import FusedExperts

PTPC = '{"global_quant_config": "ptpc_fp8"}'
# e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below
# 2^-6 (subnormal) the spacing is 2^-9, so the error is at most 2^-10 absolute.
RELATIVE_BOUND, SUBNORMAL_BOUND = 2.0**-4, 2.0**-10


def test_round_trip_stays_within_e4m3_rounding():
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 2, 64).unsqueeze(1)
    weight[3] = 0.0  # an all-zero row stays zero and finite
    codes, scale = quantize_rows(weight)
    assert codes.dtype == FP8_DTYPE and scale.shape == (64, 1)
    assert scale.dtype == torch.float32
    back = dequantize_rows(codes, scale)
    bound = weight.abs() * RELATIVE_BOUND + scale * SUBNORMAL_BOUND
    assert ((back - weight).abs() <= bound).all()
    assert torch.equal(back[3], torch.zeros(96))
    # Each row's largest magnitude lands on e4m3's largest value, exactly.
    peak = weight.abs().argmax(dim=1)
    rows = torch.arange(64)
    assert (codes[rows, peak].float().abs()[rows != 3] == FP8_MAX).all()


def test_fp8_linear_is_the_dequantized_product_of_per_token_rounded_inputs():
    torch.manual_seed(1)
    weight, x = torch.randn(48, 32), torch.randn(2, 5, 32) * 3
    bias = torch.randn(48)
    codes, scale = quantize_rows(weight)
    y = fp8_linear(x, codes, scale, bias)
    reference = F.linear(round_trip_rows(x), dequantize_rows(codes, scale), bias)
    torch.testing.assert_close(y, reference, rtol=1e-6, atol=1e-6)
    # and close to the unquantized product: two e4m3 roundings, ~2^-4 each at worst
    exact = F.linear(x, weight, bias)
    assert (y - exact).abs().max() < 0.05 * exact.abs().max()
    assert fp8_linear(x.bfloat16(), codes, scale).dtype == torch.bfloat16


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="torch._scaled_mm with row-wise scales needs a CUDA sm89+ GPU",
)
def test_scaled_mm_matches_the_reference_path_on_cuda():
    torch.manual_seed(2)
    weight = torch.randn(256, 128, device="cuda")
    x = torch.randn(7, 128, device="cuda", dtype=torch.bfloat16)
    codes, scale = quantize_rows(weight)
    y = fp8_linear(x, codes, scale)
    reference = fp8_linear(x.cpu(), codes.cpu(), scale.cpu())
    torch.testing.assert_close(y.cpu().float(), reference.float(), rtol=2e-2, atol=2e-2)


def load_linear(layer, weights: list[torch.Tensor]) -> None:
    """Load full checkpoint tensors (one per shard where the layer has shards),
    then quantize as the strict loader does after loading."""
    method = PtpcFp8Linear()
    layer.quant_method = method
    method.prepare(layer)
    if len(weights) == 1:
        layer.weight_loader(layer.weight, weights[0])
    for shard_id, weight in enumerate(weights if len(weights) > 1 else ()):
        layer.weight_loader(layer.weight, weight, shard_id)
    method.finish(layer)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_shards_quantize_their_own_slices(rank):
    torch.manual_seed(3)
    weight = torch.randn(64, 32)
    gate, up = torch.randn(32, 32), torch.randn(32, 32)
    with build_parallel_state(tp_rank=rank, tp_size=2):
        column, row = ColumnParallelLinear(32, 64), RowParallelLinear(64, 32)
        merged = MergedColumnParallelLinear(32, [32, 32])
        load_linear(column, [weight])
        load_linear(row, [weight.t().contiguous()])
        load_linear(merged, [gate, up])
    pieces = {
        "column": weight.chunk(2, dim=0)[rank],
        "row": weight.t().chunk(2, dim=1)[rank],
        "merged": torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]),
    }
    for name, layer in {"column": column, "row": row, "merged": merged}.items():
        codes, scale = quantize_rows(pieces[name])
        assert layer.weight.dtype == FP8_DTYPE, name
        assert torch.equal(layer.weight_scale, scale), name
        assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
    # A row-parallel shard's channel scale covers its half of the input only.
    assert not torch.equal(row.weight_scale, quantize_rows(weight.t())[1])


def test_scales_are_declared_on_the_weights_device():
    # load_target declares them after building, outside the build's device scope.
    with build_parallel_state(), torch.device("meta"):
        layer = ColumnParallelLinear(32, 64)
        experts = FusedExperts(4, 16, 32, get_act_and_mul("silu"))
    PtpcFp8Linear().prepare(layer)
    PtpcFp8Experts().prepare(experts)
    assert layer.weight_scale.device.type == "meta"
    assert layer.weight_scale.shape == (64, 1)
    assert experts.w2_scale.device.type == "meta"
    assert experts.w2_scale.shape == (4, 32, 1)


def test_fp8_experts_match_the_dequantized_reference():
    torch.manual_seed(4)
    num_experts, inner, width = 6, 16, 32
    act = get_act_and_mul("silu")
    experts = FusedExperts(num_experts, inner, width, act)
    experts.w13.data.normal_()
    experts.w2.data.normal_()
    method = PtpcFp8Experts()
    experts.quant_method = method
    method.prepare(experts)
    method.finish(experts)
    assert experts.w13.dtype == experts.w2.dtype == FP8_DTYPE
    assert experts.w13_scale.shape == (num_experts, 2 * inner, 1)
    assert not experts.graph_capturable
    x = torch.randn(9, width)
    expert_ids = torch.randint(0, 4, (9, 2))  # experts 4 and 5 stay unused
    weights = torch.rand(9, 2)
    y = experts(x, ExpertChoice(weights, expert_ids))
    w13 = dequantize_rows(experts.w13, experts.w13_scale)
    w2 = dequantize_rows(experts.w2, experts.w2_scale)
    reference = grouped_expert_mlp(
        x,
        ExpertChoice(weights, expert_ids),
        w13,
        w2,
        act,
        "loop",
        row_transform=round_trip_rows,
    )
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "online, scheme",
    [
        (PTPC, "ptpc_fp8"),
        ({"global_quant_config": "ptpc_fp8"}, "ptpc_fp8"),
        (None, None),
        ("{}", None),
    ],
)
def test_online_config_parses_json_or_a_mapping(online, scheme):
    assert QuantizationConfig.parse(online, None).online_scheme == scheme


@pytest.mark.parametrize(
    "online, message",
    [
        ('{"global_quant_config": "int4"}', "unknown global_quant_config 'int4'"),
        ('{"layer_quant_config": {}}', "unsupported keys"),
        ("ptpc_fp8", "is not valid JSON"),
        ('["ptpc_fp8"]', "must be a JSON object"),
    ],
)
def test_bad_online_config_is_refused_naming_the_flag(online, message):
    with pytest.raises(ValueError, match=message) as err:
        Config(model="tiny-kimi-k3", device="cpu", online_quant_config=online)
    assert "--online_quant_config" in str(err.value)
    if "unknown" in message:
        assert "supported: ptpc_fp8" in str(err.value)
