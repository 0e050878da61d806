"""A decode step's routing in one launch: the top-k choice, the sort by expert and
the grouped GEMM's tile list.

At a step of a token or a few, the three kernels these usually take
(`moe_routing.py`, `moe_align.py`, `expert_gemm.expert_tiles_triton`) each run for
about two microseconds, most of it launch and latency, one after the other in
every MoE layer. One program does all three here: it chooses each token's experts
(`moe_routing.select_token`), reads the choices back, counts the pairs of each
expert, places every pair at its expert's start plus the pairs of that expert in
earlier tokens (the stable order of `grouped_experts.align_to_experts`; a token's
k experts are distinct), and writes the tile list (`expert_gemm.store_tile_list`).
The work is serial over tokens, a few memory round trips each, so it serves steps
of up to `ROUTE_SORT_MAX_TOKENS` tokens: on an H100 it took 1.75 us a layer at one
token of the tiny Kimi model against about 5 us for the three kernels, but 6.4 us
at a DSpark verify's eight (`benchmarks/profile_spec_step.py`, 2026-12-07).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import rows_per_chunk
from atom.kernels.expert_gemm import store_tile_list, tile_bound
from atom.kernels.moe_routing import select_token, selection_constants

# The most tokens one program routes and sorts.
ROUTE_SORT_MAX_TOKENS = 4


@triton.jit
def _route_sort_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    token_of_ptr,
    position_ptr,
    group_ends_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tokens,
    num_experts,
    stride_logits,
    routed_scaling_factor,
    num_tiles,
    TOP_K: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    for token in range(num_tokens):
        select_token(
            logits_ptr,
            bias_ptr,
            weights_ptr,
            ids_ptr,
            tl.cast(token, tl.int64),
            num_experts,
            stride_logits,
            routed_scaling_factor,
            TOP_K,
            GROUPS,
            PER_GROUP,
            TOPK_GROUP,
            BLOCK_K,
            BLOCK_G,
            SOFTMAX,
            HAS_BIAS,
            RENORMALIZE,
            BLOCK_E,
        )
    # The ids were written by whichever threads held them: make them visible to
    # every thread of the program before they are read back.
    tl.debug_barrier()
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    picks = tl.arange(0, BLOCK_K)
    real_pick = picks < TOP_K
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for token in range(num_tokens):
        ids = tl.load(ids_ptr + token * TOP_K + picks, mask=real_pick, other=-1)
        mine = ids.to(tl.int32)[:, None] == experts[None, :]
        counts += tl.sum(mine.to(tl.int32), axis=0)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    next_row = starts
    for token in range(num_tokens):
        ids = tl.load(ids_ptr + token * TOP_K + picks, mask=real_pick, other=-1)
        mine = (ids.to(tl.int32)[:, None] == experts[None, :]).to(tl.int32)
        row = tl.sum(mine * next_row[None, :], axis=1)
        tl.store(position_ptr + token * TOP_K + picks, row, mask=real_pick)
        tl.store(token_of_ptr + row, tl.zeros_like(row) + token, mask=real_pick)
        next_row += tl.sum(mine, axis=0)
    tl.store(group_ends_ptr + experts, ends, mask=real)
    store_tile_list(
        starts, ends, real, tile_expert_ptr, tile_row_ptr, num_tiles, BLOCK_M, BLOCK_T
    )


def route_and_sort_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring: str,
    block_m: int,
) -> tuple[torch.Tensor, ...]:
    """(weights [T, k] fp32, expert ids [T, k] int64, token_of, position,
    group_ends, tile_expert, tile_row), all int32 after the ids: what
    `moe_router.select_experts_reference`, `grouped_experts.align_to_experts` and
    `expert_gemm.expert_tiles` (for `block_m`-row tiles) give, for arguments
    `moe_router.check_routing` passed and at most `ROUTE_SORT_MAX_TOKENS` tokens."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens > ROUTE_SORT_MAX_TOKENS:
        raise ValueError(
            f"{num_tokens} tokens; one program routes at most "
            f"{ROUTE_SORT_MAX_TOKENS}"
        )
    num_pairs = num_tokens * top_k
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    token_of = torch.empty(num_pairs, dtype=torch.int32, device=device)
    position = torch.empty_like(token_of)
    group_ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    num_tiles = tile_bound(num_pairs, num_experts, block_m)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=device)
    tile_row = torch.empty_like(tile_expert)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.clone()
    constants = selection_constants(
        num_experts,
        top_k,
        num_expert_group,
        topk_group,
        renormalize,
        scoring,
        correction_bias is not None,
    )
    _route_sort_kernel[(1,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        weights,
        ids,
        token_of,
        position,
        group_ends,
        tile_expert,
        tile_row,
        num_tokens,
        num_experts,
        logits.stride(0),
        routed_scaling_factor,
        num_tiles,
        BLOCK_M=block_m,
        BLOCK_T=rows_per_chunk(constants["BLOCK_E"]),
        **constants,
    )
    return weights, ids, token_of, position, group_ends, tile_expert, tile_row
