"""atom/kernels/attn_res_mix.py against the torch reference of atom/model_ops/attn_res.py."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.attn_res import attn_res_mix
from atom.model_ops.layernorm import rms_norm_reference
from tests.kernels.devices import FLOAT_CASES


@pytest.mark.kernels
@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("weight_offset", [None, 0.0, 1.0])
def test_mix_and_its_norm_equal_the_reference(device, dtype, blocks, weight_offset):
    """The mix alone (weight_offset None), and with the RMSNorm after it."""
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.attn_res_mix import attn_res_mix_triton

    gen = torch.Generator(device=device).manual_seed(blocks)
    tokens, hidden = 5, 40  # not a power of two: the row block is masked

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    # The bank as the layers grow it: a slice of a wider one, strided per token;
    # candidates of very different sizes, so the softmax weights are far apart.
    bank = randn(tokens, blocks + 1, hidden, scale=3.0)[:, :blocks]
    partial = randn(tokens, 2 * hidden)[:, :hidden]
    norm_weight = 1 + randn(hidden, scale=0.1)
    proj_weight = randn(1, hidden, scale=2.0)
    then = None
    expected = attn_res_mix(bank, partial, norm_weight, proj_weight, 1e-6)
    if weight_offset is not None:
        out_weight = randn(hidden, scale=0.5)
        then = (out_weight, 1e-5, weight_offset)
        expected = rms_norm_reference(expected, out_weight, 1e-5, weight_offset)
    out = attn_res_mix_triton(bank, partial, norm_weight, proj_weight, 1e-6, then)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.kernels
def test_no_tokens_gives_an_empty_mix():
    if not triton_available("cpu"):
        pytest.skip("triton cannot run here")
    from atom.kernels.attn_res_mix import attn_res_mix_triton

    out = attn_res_mix_triton(
        torch.zeros(0, 2, 8), torch.zeros(0, 8), torch.ones(8), torch.ones(1, 8), 1e-6
    )
    assert out.shape == (0, 8)
