"""atom/kernels/kda_head_norms.py against l2_normalize and kda_output_norm_gate."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.kda import kda_output_norm_gate, l2_normalize
from tests.kernels.devices import DEVICES

HEADS, DIM = 3, 24  # a head width that is no power of two


def dtypes(device):
    return [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_l2_normalize_qk_equals_the_reference(device):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.kda_head_norms import l2_normalize_qk

    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes(device):
        # [B, T, q | k | v]: the conv's output layout, v left alone.
        mixed = torch.randn(2, 3, 3 * HEADS * DIM, generator=gen, device=device)
        mixed = mixed.to(dtype)
        q, k = l2_normalize_qk(mixed, HEADS, DIM)
        ref_q, ref_k, _ = (
            part.reshape(2, 3, HEADS, DIM) for part in mixed.chunk(3, dim=-1)
        )
        assert q.dtype == k.dtype == torch.float32 and q.shape == (2, 3, HEADS, DIM)
        torch.testing.assert_close(q, l2_normalize(ref_q), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k, l2_normalize(ref_k), rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
def test_output_norm_gate_equals_the_reference(device):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.kda_head_norms import output_norm_gate

    gen = torch.Generator(device=device).manual_seed(1)
    o = torch.randn(5, HEADS, DIM, generator=gen, device=device)
    weight = torch.randn(DIM, generator=gen, device=device)
    # The gate as a projection's strided view.
    gate = torch.randn(5, 2 * HEADS * DIM, generator=gen, device=device)
    gate = gate[:, : HEADS * DIM]
    for dtype in dtypes(device):
        out = output_norm_gate(o, weight, gate.to(dtype), 1e-5, dtype)
        ref = kda_output_norm_gate(o, weight, gate.to(dtype), 1e-5).to(dtype)
        assert out.dtype == dtype and out.shape == (5, HEADS * DIM)
        tolerance = {} if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, ref, **tolerance)
