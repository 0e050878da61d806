"""Token/expert alignment in Triton: the step's (token, choice) pairs sorted by
expert, in one launch.

The torch reference is `atom.model_ops.grouped_experts.align_to_experts`: a stable
argsort of the flat expert ids, per-expert counts, their running sum, the inverse
permutation and each sorted row's token, about eight kernels per MoE layer. Here
each expert has a program: it counts the pairs of lower experts (its group's start),
then walks the ids again and places each of its own pairs at that start plus the
number of its earlier pairs (the stable order). The programs run side by side, and
each holds one row of ids at a time, not a [pairs, experts] comparison, so a step
of 128 tokens takes about what one of a token does. Each program reads every id
twice, so the total work grows with pairs x experts: it serves decode-sized steps,
and the reference's caller sends larger ones to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Ids a program reads per chunk: one step of up to 128 tokens of top 8 in one go.
_MAX_CHUNK = 1024


@triton.jit
def _align_kernel(
    ids_ptr,
    token_of_ptr,
    position_ptr,
    group_ends_ptr,
    num_pairs,
    pairs_per_token,
    BLOCK_N: tl.constexpr,
):
    expert = tl.program_id(0)
    pairs = tl.arange(0, BLOCK_N)
    start = 0
    for first in range(0, num_pairs, BLOCK_N):
        inside = first + pairs < num_pairs
        ids = tl.load(ids_ptr + first + pairs, mask=inside, other=2147483647)
        start += tl.sum((ids.to(tl.int32) < expert).to(tl.int32), axis=0)
    next_row = start
    for first in range(0, num_pairs, BLOCK_N):
        inside = first + pairs < num_pairs
        ids = tl.load(ids_ptr + first + pairs, mask=inside, other=-1)
        mine = (ids.to(tl.int32) == expert).to(tl.int32)
        row = next_row + tl.cumsum(mine, axis=0) - mine
        tl.store(position_ptr + first + pairs, row, mask=mine > 0)
        tl.store(token_of_ptr + row, (first + pairs) // pairs_per_token, mask=mine > 0)
        next_row += tl.sum(mine, axis=0)
    tl.store(group_ends_ptr + expert, next_row)


def align_to_experts_triton(
    expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_of, position, group_ends), int32, for the ids [T, k]: the reference's
    contract (`grouped_experts.align_to_experts`)."""
    ids = expert_ids.reshape(-1)
    num_pairs = ids.numel()
    token_of = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    position = torch.empty_like(token_of)
    group_ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _align_kernel[(num_experts,)](
        ids,
        token_of,
        position,
        group_ends,
        num_pairs,
        expert_ids.shape[-1],
        BLOCK_N=min(_MAX_CHUNK, triton.next_power_of_2(max(num_pairs, 16))),
    )
    return token_of, position, group_ends
