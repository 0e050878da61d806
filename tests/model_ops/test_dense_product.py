"""model_ops/dense_product.py: every dense product equals F.linear, whichever kernel
runs it (the skinny GEMM for few half-precision rows on CUDA, or a decode batch's
rows of a narrow weight; cuBLAS otherwise)."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.skinny_gemm import (
    NARROW_MAX_COLUMNS,
    NARROW_MAX_ROWS,
    SKINNY_MAX_ROWS,
)
from atom.model_ops.dense_product import dense_linear

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows", [1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, NARROW_MAX_ROWS + 1]
)
@pytest.mark.parametrize("width", [40, NARROW_MAX_COLUMNS + 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_linear_at_every_row_count(device, rows, width, dtype):
    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen, device=device).to(dtype)
    weight = (torch.randn(width, 96, generator=gen, device=device) / 10).to(dtype)
    bias = torch.randn(width, generator=gen, device=device).to(dtype)
    out = dense_linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, width)
    expected = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
    tolerance = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weights_take_half_activations_at_their_precision(device):
    """The router's product: bf16 activations, fp32 weights, an fp32 result."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 1, 64, generator=gen, device=device).to(torch.bfloat16)
    weight = torch.randn(8, 64, generator=gen, device=device)
    out = dense_linear(x, weight, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == (2, 1, 8)
    torch.testing.assert_close(out, F.linear(x.float(), weight))
