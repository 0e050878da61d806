"""The fp8 kernels of ptpc_fp8 against their torch references: the per-token
quantization (atom/kernels/fp8_quant.py) against `quantize_rows`, the fp8 grouped
GEMM (atom/kernels/expert_gemm.py) against dequantized products, and the routed
experts built on them against `PtpcFp8Experts.reference`.

Triton's interpreter runs both GEMM variants on the CPU: its dot takes e4m3
operands (it widens them exactly), so the e4m3 dot and the fp16 decoding are
checked there as well as natively on a GPU."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.activation import get_act_and_mul
from atom.model_ops.grouped_experts import ExpertChoice
from atom.model_ops.quantization.ptpc_fp8 import (
    MIN_SCALE,
    PtpcFp8Experts,
    dequantize_rows,
    fp8_expert_mlp,
    quantize_rows,
)
from atom.model_ops.routed_experts import FusedExperts
from tests.kernels.devices import DEVICES


def decode_variants(device: str) -> list[bool]:
    """True: the fp16 decoding, which runs anywhere; False: the e4m3 dot."""
    from atom.kernels.expert_gemm import fp8_dot_native

    return [True] + ([False] if fp8_dot_native(torch.device(device)) else [])


def needs_triton(device: str) -> None:
    if not triton_available(device):
        pytest.skip("triton cannot run here")


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [72, 4100])  # one block; several blocks per row
def test_quantize_rows_kernel_gives_the_reference_codes(device, dtype, width):
    needs_triton(device)
    from atom.kernels.fp8_quant import quantize_rows_triton

    gen = torch.Generator(device=device).manual_seed(width)
    # Magnitudes over 6 decades put codes in e4m3's subnormal range and on every
    # binade edge; strided rows, as a split leaves them.
    spread = torch.logspace(-3, 3, width, device=device)
    wide = torch.randn(6, 2 * width, generator=gen, device=device)
    x = (wide[:, :width] * spread).to(dtype)
    x[2] = 0.0  # an all-zero row: scale MIN_SCALE, codes 0
    codes, scale = quantize_rows_triton(x, MIN_SCALE)
    # The reference runs on the CPU, whose divisions are IEEE ones as the kernel's
    # are: torch on CUDA divides by a scalar through its reciprocal (1 ulp apart).
    expected_codes, expected_scale = quantize_rows(x.cpu())
    assert codes.dtype == expected_codes.dtype and scale.shape == (6, 1)
    torch.testing.assert_close(scale.cpu(), expected_scale, rtol=0, atol=0)
    # Rounded as torch rounds (nearest, ties to even): the same bits.
    assert torch.equal(codes.cpu().view(torch.uint8), expected_codes.view(torch.uint8))


def grouped_reference(codes, row_scale, weight, weight_scale, counts, source):
    rows = dequantize_rows(codes, row_scale)[source]
    experts = dequantize_rows(weight, weight_scale)
    blocks = rows.split(counts.tolist())
    return torch.cat([block @ experts[e].T for e, block in enumerate(blocks)])


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_rows", [1, 6, 70])  # decode and prefill tile heights
@pytest.mark.parametrize("gather", [False, True])
def test_fp8_grouped_gemm_is_the_dequantized_product(device, num_rows, gather):
    needs_triton(device)
    from atom.kernels.expert_gemm import fp8_expert_gemm

    gen = torch.Generator().manual_seed(num_rows)
    # Widths off the tiles exercise the masks; expert 1 gets no rows.
    experts, n, k = 5, 40, 200
    x = torch.randn(num_rows, k, generator=gen) * 4
    codes, row_scale = quantize_rows(x)
    weight, weight_scale = quantize_rows(torch.randn(experts, n, k, generator=gen))
    source = (
        torch.randint(0, num_rows, (num_rows,), generator=gen)
        if gather
        else torch.arange(num_rows)
    )
    sizes = [len(part) for part in torch.arange(num_rows).tensor_split(4)]
    counts = torch.tensor([sizes[0], 0, *sizes[1:]])
    expected = grouped_reference(codes, row_scale, weight, weight_scale, counts, source)
    group_ends = counts.cumsum(0).to(device)
    operands = [t.to(device) for t in (codes, row_scale, weight, weight_scale)]
    for decode in decode_variants(device):
        out = fp8_expert_gemm(
            *operands,
            group_ends,
            source.to(device) if gather else None,
            out_dtype=torch.float32,
            decode=decode,
        )
        assert out.shape == (num_rows, n) and out.dtype == torch.float32
        # The products of e4m3 values are exact; only the fp32 sums' order differs,
        # except in Hopper's fp8 MMA, which adds inside each K slice with fewer
        # mantissa bits (2e-4 of the largest output measured on an H200).
        native_mma = device == "cuda" and not decode
        error = (out.cpu() - expected).abs().max() / expected.abs().max()
        assert error < (1e-3 if native_mma else 1e-5), (decode, error.item())


def fp8_experts(device: str, dtype: torch.dtype) -> FusedExperts:
    torch.manual_seed(4)
    experts = FusedExperts(6, 40, 48, get_act_and_mul("silu"))
    experts.w13.data.normal_()
    experts.w2.data.normal_(std=0.2)
    experts.to(device, dtype)
    method = PtpcFp8Experts()
    experts.quant_method = method
    method.prepare(experts)
    method.finish(experts)
    return experts


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fp8_experts_match_the_reference(device, num_tokens):
    needs_triton(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts = fp8_experts(device, dtype)
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, 48, generator=gen, device=device).to(dtype)
    # Experts 4 and 5 stay unused.
    ids = torch.randint(0, 4, (num_tokens, 2), generator=gen, device=device)
    weights = torch.rand(num_tokens, 2, generator=gen, device=device)
    choice = ExpertChoice(weights, ids)
    expected = experts.quant_method.reference(experts, x, choice)
    # fp32 rows round to the same codes as the reference's; bf16 ones round the
    # first product before its activation is quantized again.
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for decode in decode_variants(device):
        out = fp8_expert_mlp(x, choice, experts, decode=decode)
        assert out.dtype == torch.float32
        error = (out - expected).abs().max() / expected.abs().max()
        assert error < tolerance, (decode, error.item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_experts_run_the_kernels_in_a_cuda_graph():
    """The reference reads the used experts on the host, which turned CUDA graphs
    off for every ptpc_fp8 model; the kernels' path is captured and replays the
    eager result."""
    experts = fp8_experts("cuda", torch.bfloat16)
    assert experts.quant_method.kernels and experts.graph_capturable
    x = torch.randn(6, 48, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 6, (6, 2), device="cuda")
    weights = torch.rand(6, 2, device="cuda")
    choice = ExpertChoice(weights, ids)
    eager = experts(x, choice)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts(x, choice)
    graph.replay()
    torch.testing.assert_close(captured, eager)
