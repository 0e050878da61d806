"""atom/kernels/head_norm_rope.py against norm_and_rotate's torch path
(atom/model_ops/rotary_embedding.py), which is what runs off CUDA."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.layernorm import GemmaRMSNorm, RMSNorm
from atom.model_ops.rotary_embedding import RotaryEmbedding, norm_and_rotate
from tests.kernels.devices import FLOAT_CASES

HEADS = 3
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}


@pytest.mark.kernels
@pytest.mark.parametrize("device,dtype", FLOAT_CASES)
@pytest.mark.parametrize(
    "head_dim, rotary_dim, norm_kind, scaling",
    [
        (32, 32, RMSNorm, None),  # the Qwen3 draft: every channel rotates
        (24, 16, GemmaRMSNorm, None),  # MiniMax-M3: a partial rotation, 1 + w
        (40, 8, RMSNorm, YARN),  # YaRN's cos/sin scale
    ],
)
def test_head_norm_rope_equals_the_reference(
    device, dtype, head_dim, rotary_dim, norm_kind, scaling
):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.head_norm_rope import head_norm_rope_triton

    gen = torch.Generator().manual_seed(head_dim)
    norm = norm_kind(head_dim, eps=1e-6)
    norm.weight.data = torch.randn(head_dim, generator=gen) * 0.5
    rotary = RotaryEmbedding(rotary_dim, 10000.0, scaling, interleaved=False)
    # Heads as a projection's split leaves them: a strided view of wider rows.
    wide = torch.randn(7, 2 * HEADS * head_dim, generator=gen)
    x = wide[:, : HEADS * head_dim].unflatten(-1, (HEADS, head_dim)).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 1000, 123456])
    want = norm_and_rotate(x, norm, rotary, positions)

    norm.to(device)
    rotary.to(device)
    got = head_norm_rope_triton(
        x.to(device),
        norm.weight,
        norm.eps,
        norm.weight_offset,
        positions.to(device),
        rotary.inv_freq,
        rotary.cos_sin_scale,
    )
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}
    torch.testing.assert_close(got.cpu(), want, **tolerance)
