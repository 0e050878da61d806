"""atom/kernels/skinny_gemm.py against F.linear in fp32."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import triton_available
from atom.kernels.skinny_gemm import (
    NARROW_MAX_COLUMNS,
    NARROW_MAX_ROWS,
    SKINNY_MAX_ROWS,
    SkinnyTiles,
    skinny_linear,
    skinny_max_rows,
    skinny_tiles,
)
from tests.kernels.devices import FLOAT_CASES

pytestmark = pytest.mark.kernels


def _operands(device, dtype, rows, n, k, weight_dtype=None):
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    weight = torch.randn(n, k, generator=gen, device=device) / k**0.5
    bias = torch.randn(n, generator=gen, device=device)
    return x, weight.to(weight_dtype or dtype), bias.to(weight_dtype or dtype)


@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
@pytest.mark.parametrize("rows", [1, 3, SKINNY_MAX_ROWS])
@pytest.mark.parametrize("n,k", [(37, 70), (64, 256), (5, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_fp32_linear(device, dtype, rows, n, k, with_bias):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    x, weight, bias = _operands(device, dtype, rows, n, k)
    bias = bias if with_bias else None
    out = skinny_linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = F.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    )
    tolerance = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), **tolerance)


@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
@pytest.mark.parametrize(
    "tiles", [SkinnyTiles(1, 32, 4), SkinnyTiles(16, 64, 4), SkinnyTiles(64, 128, 8)]
)
def test_every_tiling_gives_the_same_product(device, dtype, tiles):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    x, weight, _ = _operands(device, dtype, 2, 45, 200)
    expected = skinny_linear(x, weight, out_dtype=torch.float32)
    out = skinny_linear(x, weight, out_dtype=torch.float32, tiles=tiles)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
def test_half_activations_against_fp32_weights_give_fp32(device, dtype):
    """The router's product: activations in the model dtype, weights and result fp32."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    x, weight, _ = _operands(device, dtype, 1, 16, 96, weight_dtype=torch.float32)
    out = skinny_linear(x.view(1, 1, 96), weight, out_dtype=torch.float32)
    assert out.shape == (1, 1, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.view(1, 16), F.linear(x.float(), weight))


def test_refuses_more_rows_and_mismatched_widths():
    x = torch.zeros(SKINNY_MAX_ROWS + 1, 8)
    with pytest.raises(ValueError, match="up to"):
        skinny_linear(x, torch.zeros(NARROW_MAX_COLUMNS + 1, 8))
    with pytest.raises(ValueError, match="does not match"):
        skinny_linear(torch.zeros(1, 8), torch.zeros(4, 9))


def test_tiles_spread_narrow_products_over_the_gpu():
    # A 16-column product on 132 units: a column a program, K in as few steps as fit.
    assert skinny_tiles(1, 16, 2304, 132) == SkinnyTiles(1, 2048, 4)
    # Wide products: 16 columns a program, 512 of K a step.
    assert skinny_tiles(1, 163840, 2304, 132) == SkinnyTiles(16, 512, 8)
    # Fewer columns a program where the grid would not cover the GPU twice.
    assert skinny_tiles(1, 2304, 2048, 132) == SkinnyTiles(8, 512, 4)
    # Eight rows keep the product tile within 8K elements; K never below 32.
    eight = skinny_tiles(8, 6144, 2304, 132)
    assert 8 * eight.block_n * eight.block_k <= 8192 and eight.block_k >= 32
    assert skinny_tiles(1, 2048, 16, 132).block_k == 32


@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
@pytest.mark.parametrize("rows", [SKINNY_MAX_ROWS + 1, 37, NARROW_MAX_ROWS])
def test_narrow_products_take_a_decode_batch_of_rows(device, dtype, rows):
    """The router's product at a large decode batch: row blocks of SKINNY_MAX_ROWS,
    a partial last one included, each equal to the fp32 product."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    x, weight, _ = _operands(device, dtype, rows, 32, 96, weight_dtype=torch.float32)
    out = skinny_linear(x, weight, out_dtype=torch.float32)
    torch.testing.assert_close(out, F.linear(x.float(), weight))


def test_only_narrow_products_take_more_rows():
    assert skinny_max_rows(NARROW_MAX_COLUMNS) == NARROW_MAX_ROWS
    assert skinny_max_rows(NARROW_MAX_COLUMNS + 1) == SKINNY_MAX_ROWS
    with pytest.raises(ValueError, match="up to 8 rows of a 65-column"):
        skinny_linear(torch.zeros(9, 8), torch.zeros(65, 8))
    with pytest.raises(ValueError, match="up to 256 rows of a 32-column"):
        skinny_linear(torch.zeros(257, 8), torch.zeros(32, 8))
