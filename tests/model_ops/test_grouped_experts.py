"""Routed experts as grouped GEMMs: the one-kernel path equals the per-group loop and
a direct per-token sum, on CPU and (when present) CUDA."""

import pytest
import torch
import torch.nn.functional as F

from atom.model_ops.grouped_experts import grouped_expert_mlp, grouped_mm_supported

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def direct(x, weights, ids, w13, w2):
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            y = F.linear(silu_and_mul(F.linear(x[t], w13[e])), w2[e])
            out[t] += weights[t, k] * y.float().cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_grouped_and_loop_paths_equal_the_direct_sum(device, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inner, top_k = 8, 32, 16, 3
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=gen) / inner**0.5
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in x])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    expected = direct(x, weights, ids, w13, w2)
    args = [t.to(device) for t in (x, weights, ids, w13, w2)]
    assert grouped_mm_supported(torch.device("cpu"), torch.float32, hidden, inner)
    for use_grouped_mm in (True, False):
        out = grouped_expert_mlp(*args, silu_and_mul, use_grouped_mm)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_misaligned_widths_fall_back_to_the_loop():
    assert not grouped_mm_supported(torch.device("cpu"), torch.float32, 30, 16)
    assert not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, 12)
