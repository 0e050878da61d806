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
