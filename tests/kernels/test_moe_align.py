"""atom/kernels/moe_align.py against align_to_experts, and the grouped GEMM's tile
list (expert_gemm.expert_tiles_triton) against expert_tiles."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import align_to_experts
from tests.kernels.devices import DEVICES

# (200, 8, 32): more pairs than a program reads in one chunk.
SHAPES = [(1, 8, 32), (5, 3, 12), (37, 8, 32), (300, 2, 8), (4, 2, 130), (200, 8, 32)]


def skewed_ids(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Skewed routing (some experts unused, some crowded), as real routers give."""
    gen = torch.Generator().manual_seed(tokens * experts)
    weights = torch.rand(experts, generator=gen) ** 4
    return torch.multinomial(weights.expand(tokens, -1), top_k, generator=gen)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,experts", SHAPES)
def test_alignment_equals_the_reference(device, tokens, top_k, experts):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.moe_align import align_to_experts_triton

    ids = skewed_ids(tokens, top_k, experts)
    token_of, position, ends = align_to_experts_triton(ids.to(device), experts)
    ref_token_of, ref_position, ref_ends = align_to_experts(ids, experts)
    assert torch.equal(token_of.cpu().long(), ref_token_of)
    assert torch.equal(position.cpu().long(), ref_position)
    assert torch.equal(ends.cpu(), ref_ends)


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,experts", SHAPES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_list_equals_the_reference(device, tokens, top_k, experts, block_m):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import expert_tiles, expert_tiles_triton

    _, _, ends = align_to_experts(skewed_ids(tokens, top_k, experts), experts)
    num_rows = tokens * top_k
    tile_expert, tile_row = expert_tiles_triton(ends.to(device), num_rows, block_m)
    ref_expert, ref_row = expert_tiles(ends, num_rows, block_m)
    assert torch.equal(tile_expert.cpu(), ref_expert)
    real = ref_expert < experts  # a padding tile's row is never read
    assert torch.equal(tile_row.cpu()[real], ref_row[real])
