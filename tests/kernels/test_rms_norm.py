"""atom/kernels/rms_norm.py against the torch reference of atom/model_ops/layernorm.py."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.layernorm import rms_norm_reference
from tests.kernels.devices import FLOAT_CASES


@pytest.mark.kernels
@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_norm_and_add_then_norm_equal_the_reference(device, dtype, weight_offset):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.rms_norm import rms_norm_triton

    gen = torch.Generator(device=device).manual_seed(0)
    width = 72  # not a power of two: the row block is masked
    wide = torch.randn(5, 2 * width, generator=gen, device=device).to(dtype)
    x = wide[:, :width]  # strided rows, as a split leaves them
    residual = torch.randn(5, width, generator=gen, device=device).to(dtype)
    weight = torch.randn(width, generator=gen, device=device)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    out = rms_norm_triton(x, weight, 1e-6, weight_offset)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(
        out, rms_norm_reference(x, weight, 1e-6, weight_offset), **tolerance
    )
    out, summed = rms_norm_triton(x, weight, 1e-6, weight_offset, residual=residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(
        out, rms_norm_reference(x + residual, weight, 1e-6, weight_offset), **tolerance
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA")
def test_the_disable_flag_sends_norms_to_the_reference(monkeypatch):
    from atom.kernels import DISABLE_ENV
    from atom.model_ops.layernorm import use_norm_kernel

    x = torch.zeros(1, 8, device="cuda")
    with torch.no_grad():
        assert use_norm_kernel(x) == triton_available("cuda")
        monkeypatch.setenv(DISABLE_ENV, "1")
        assert not use_norm_kernel(x)
