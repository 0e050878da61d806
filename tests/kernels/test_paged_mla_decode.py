"""atom/kernels/paged_mla_decode.py (the triton MLA backend) against the torch one."""

import pytest
import torch

from atom.kernels import triton_available
from atom.kernels.context_splits import combine, combine_reference
from atom.model_ops.attention_backend import (
    LatentLayer,
    TorchMLABackend,
    select_mla_backend,
)
from atom.model_ops.paged_cache import FP8_KV_DTYPE
from tests.kernels.devices import DEVICES
from tests.kernels.paged_helpers import BLOCK_SIZE, CONTEXTS, NUM_BLOCKS, step

HEADS, NOPE, ROPE, RANK, V_DIM = 3, 8, 16, 32, 8


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_triton_backend_attends_as_the_torch_backend(device, rows, fp8_cache):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(rows)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    metadata = step(device, rows)
    cache = randn(NUM_BLOCKS, BLOCK_SIZE, RANK + ROPE)
    # Block 0 pads the tables and block 2 is nobody's: neither may be read.
    cache[0] = cache[2] = float("nan")
    # An fp8 cache holds value / kv_scale; both backends read it back * kv_scale.
    kv_scale = 0.5 if fp8_cache else 1.0
    if fp8_cache:
        cache = (cache.float() / kv_scale).to(FP8_KV_DTYPE)
    tokens = len(CONTEXTS) * rows
    q_nope, q_pe = randn(tokens, HEADS, NOPE), randn(tokens, HEADS, ROPE)
    latent = randn(tokens, RANK + ROPE)
    kv_b = randn(HEADS * (NOPE + V_DIM), RANK) / 4
    triton = select_mla_backend(device, "triton")
    assert triton.name == "triton"
    caches = [cache.clone(), cache.clone()]
    outputs = [
        backend.forward(
            q_nope, q_pe, latent, LatentLayer(c, kv_scale, kv_b, V_DIM, 0.3), metadata
        ).float()
        for backend, c in zip((triton, TorchMLABackend()), caches)
    ]
    # Both wrote this step's rows to the same slots.
    assert torch.equal(caches[0].float().nan_to_num(), caches[1].float().nan_to_num())
    tolerance = {} if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(outputs[0], outputs[1], **tolerance)


@pytest.mark.kernels
@pytest.mark.parametrize("device", ["reference", *DEVICES])
def test_splits_merge_to_one_softmax(device):
    merge = combine_reference if device == "reference" else combine
    if merge is combine and not triton_available(device):
        pytest.skip("triton cannot run here")
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 10, generator=gen)  # [rows, heads, keys]
    values = torch.randn(2, 10, 4, generator=gen)
    expected = torch.einsum("rhk,rkc->rhc", scores.softmax(-1), values)
    acc, stats = [], []
    for keys in (slice(0, 6), slice(6, 10), slice(10, 10)):  # the last split empty
        part = scores[..., keys]
        m = part.amax(-1) if part.shape[-1] else torch.full((2, 3), float("-inf"))
        p = torch.exp(part - m.unsqueeze(-1)) if part.shape[-1] else part
        acc.append(torch.einsum("rhk,rkc->rhc", p, values[:, keys]))
        stats.append(torch.stack([m, p.sum(-1)], -1))
    where = "cpu" if device == "reference" else device
    merged = merge(torch.stack(acc, 1).to(where), torch.stack(stats, 1).to(where))
    torch.testing.assert_close(merged.cpu(), expected)
    # A row no split saw a key for merges to zeros, not nan.
    empty = torch.stack([torch.full((2, 3), float("-inf")), torch.zeros(2, 3)], -1)
    blank = merge(torch.zeros(2, 1, 3, 4).to(where), empty.unsqueeze(1).to(where))
    assert torch.equal(blank.cpu(), torch.zeros(2, 3, 4))
