"""atom/kernels/moe_align.py against align_to_experts and expert_tiles."""

import pytest
import torch

from atom.kernels import triton_available
from atom.model_ops.grouped_experts import align_to_experts

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m",
    [(1, 8, 32, 16), (5, 3, 12, 16), (37, 8, 32, 64), (300, 2, 8, 16), (4, 2, 130, 16)],
)
def test_alignment_equals_the_reference(device, tokens, top_k, experts, block_m):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    from atom.kernels.expert_gemm import expert_tiles
    from atom.kernels.moe_align import align_to_experts_triton

    gen = torch.Generator(device="cpu").manual_seed(tokens * experts)
    # Skewed routing (some experts unused, some crowded), as real routers give.
    weights = torch.rand(experts, generator=gen) ** 4
    ids = torch.multinomial(weights.expand(tokens, -1), top_k, generator=gen)
    ids = ids.to(device)
    order, position, ends, tile_expert, tile_row = align_to_experts_triton(
        ids, experts, block_m
    )
    ref_order, ref_position, ref_ends = align_to_experts(ids.cpu(), experts)
    assert torch.equal(order.cpu().long(), ref_order)
    assert torch.equal(position.cpu().long(), ref_position)
    assert torch.equal(ends.cpu(), ref_ends)
    ref_tile_expert, ref_tile_row = expert_tiles(ref_ends, ids.numel(), block_m)
    assert torch.equal(tile_expert.cpu(), ref_tile_expert)
    # Rows of padding tiles (expert == E) are never read.
    real = ref_tile_expert < experts
    assert torch.equal(tile_row.cpu()[real], ref_tile_row[real])
    assert torch.equal(align_to_experts_triton(ids, experts)[0].cpu().long(), ref_order)
