"""Token/expert alignment in Triton: the step's (token, choice) pairs sorted by
expert, in one launch.

The torch reference is `atom.model_ops.grouped_experts.align_to_experts`: a stable
argsort of the flat expert ids, per-expert counts, their running sum, the inverse
permutation and, for the tiled grouped GEMM, each tile's expert and first row
(`expert_gemm.expert_tiles`), a dozen kernels per MoE layer. Here one program walks
the ids in chunks: it counts the experts, then places each pair at its expert's
start plus the number of earlier pairs of that expert (the stable order), then lays
the tiles out. Its work grows with pairs x experts, so it serves decode-sized steps;
the reference's caller sends larger ones to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.utils.arithmetic import ceil_div


@triton.jit
def _align_kernel(
    ids_ptr,
    order_ptr,
    position_ptr,
    group_ends_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_pairs,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    pairs = tl.arange(0, BLOCK_N)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for first in range(0, num_pairs, BLOCK_N):
        inside = first + pairs < num_pairs
        ids = tl.load(ids_ptr + first + pairs, mask=inside, other=-1).to(tl.int32)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(hits, axis=0)
    ends = tl.cumsum(counts, axis=0)
    tl.store(group_ends_ptr + experts, ends, mask=experts < num_experts)
    # Each pair's sorted row: its expert's start plus the earlier pairs of it.
    next_row = ends - counts
    for first in range(0, num_pairs, BLOCK_N):
        inside = first + pairs < num_pairs
        ids = tl.load(ids_ptr + first + pairs, mask=inside, other=-1).to(tl.int32)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hits, axis=0) - hits + next_row[None, :]
        row = tl.sum(hits * before, axis=1)
        tl.store(position_ptr + first + pairs, row, mask=inside)
        tl.store(order_ptr + row, first + pairs, mask=inside)
        next_row += tl.sum(hits, axis=0)
    if TILES:
        # Tile t belongs to the expert whose tiles end first after t: the number of
        # experts whose tiles end at or before t (padding tiles get num_experts).
        tiles_of = (counts + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles_of, axis=0)
        tile_ends = tl.where(experts < num_experts, tile_ends, 2147483647)
        starts = ends - counts
        for first in range(0, num_tiles, BLOCK_N):
            tile = first + pairs
            before = (tile_ends[None, :] <= tile[:, None]).to(tl.int32)
            expert = tl.sum(before, axis=1)
            mine = experts[None, :] == expert[:, None]
            first_tile = tl.sum(tl.where(mine, tile_ends - tiles_of, 0), axis=1)
            start = tl.sum(tl.where(mine, starts, 0), axis=1)
            inside = tile < num_tiles
            tl.store(tile_expert_ptr + tile, expert, mask=inside)
            tl.store(
                tile_row_ptr + tile, start + (tile - first_tile) * BLOCK_M, mask=inside
            )


def align_to_experts_triton(
    expert_ids: torch.Tensor, num_experts: int, block_m: int | None = None
) -> tuple[torch.Tensor, ...]:
    """(order, position, group_ends) for the flat ids [N], and with `block_m` also
    (tile_expert, tile_row) over ceil(N / block_m) + E tiles, all int32; the
    reference's contract (`grouped_experts.align_to_experts`)."""
    ids = expert_ids.reshape(-1)
    num_pairs = ids.numel()
    device = ids.device
    order = torch.empty(num_pairs, dtype=torch.int32, device=device)
    position = torch.empty_like(order)
    group_ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    num_tiles = ceil_div(num_pairs, block_m) + num_experts if block_m else 0
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=device)
    tile_row = torch.empty_like(tile_expert)
    block_e = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](
        ids,
        order,
        position,
        group_ends,
        tile_expert,
        tile_row,
        num_pairs,
        num_experts,
        num_tiles,
        BLOCK_M=block_m or 1,
        TILES=block_m is not None,
        # Chunks of pairs x experts of about 16K elements keep registers in bounds.
        BLOCK_N=max(16, min(128, 16384 // block_e)),
        BLOCK_E=block_e,
    )
    if block_m is None:
        return order, position, group_ends
    return order, position, group_ends, tile_expert, tile_row
