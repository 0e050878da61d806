"""The grouped expert GEMM gives the same product under any `GemmTiles`: the tile
shapes and pipelining `benchmarks/tune_expert_gemm.py` times (interpreted on CPU,
natively on CUDA)."""

import pytest
import torch
import torch.nn.functional as F

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import align_to_experts
from tests.kernels.devices import DEVICES


def tile_choices():
    from atom.kernels.expert_gemm import GemmTiles

    return [
        None,  # default_tiles
        # fp32 operands: each fits the 227 KiB of shared memory of an sm90 SM.
        GemmTiles(16, 32, 32, num_warps=2, num_stages=2),
        GemmTiles(32, 128, 64, num_warps=8, num_stages=3),
        GemmTiles(64, 64, 128, num_warps=4, num_stages=2),
    ]


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 23])
@pytest.mark.parametrize("choice", range(4))
def test_every_tile_choice_gives_the_grouped_product(device, tokens, choice):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import expert_gemm

    gen = torch.Generator().manual_seed(tokens)
    # Widths off every tile size: the masks of N and K are exercised.
    experts, top_k, n, k = 6, 2, 72, 40
    ids = torch.stack(
        [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    token_of, _, ends = align_to_experts(ids, experts)
    x = torch.randn(tokens, k, generator=gen)
    weight = torch.randn(experts, n, k, generator=gen) / k**0.5
    expected = torch.empty(token_of.numel(), n)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        expected[start:end] = F.linear(x[token_of[start:end]], weight[expert])
        start = end
    out = expert_gemm(
        x.to(device),
        weight.to(device),
        ends.to(device),
        token_of.to(device=device, dtype=torch.int32),
        tiles=tile_choices()[choice],
    )
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
