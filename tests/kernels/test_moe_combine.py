"""atom/kernels/moe_combine.py against combine_expert_rows (torch, on the CPU)."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import combine_expert_rows
from tests.kernels.devices import DEVICES


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,width", [(1, 8, 72), (6, 3, 40), (9, 2, 1300)])
def test_combine_equals_the_reference(device, tokens, top_k, width):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.moe_combine import combine_expert_rows_triton

    gen = torch.Generator().manual_seed(tokens)
    position = torch.randperm(tokens * top_k, generator=gen).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        y = torch.randn(tokens * top_k, width, generator=gen).to(dtype)
        out = combine_expert_rows_triton(
            y.to(device), position.to(device), weights.to(device)
        )
        assert out.dtype == torch.float32 and out.shape == (tokens, width)
        ref = combine_expert_rows(y, position, weights)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_combine_adds_the_shared_output_and_rounds_once(device):
    """The shared experts' output joins the fp32 sum, which is rounded to the
    model's dtype once: the MoE block's output at one rank."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.moe_combine import combine_expert_rows_triton

    gen = torch.Generator().manual_seed(3)
    tokens, top_k, width = 5, 4, 300
    position = torch.randperm(tokens * top_k, generator=gen).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    y = torch.randn(tokens * top_k, width, generator=gen)
    # A strided addend, as a slice of a wider buffer would be.
    addend = torch.randn(tokens, 2 * width, generator=gen)[:, :width]
    for dtype in (torch.float32, torch.float16):
        out = combine_expert_rows_triton(
            y.to(device),
            position.to(device),
            weights.to(device),
            addend.to(device),
            dtype,
        )
        assert out.dtype == dtype
        ref = combine_expert_rows(y, position, weights, addend, dtype)
        summed = combine_expert_rows(y, position, weights) + addend
        torch.testing.assert_close(ref, summed.to(dtype), rtol=0, atol=0)
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)
