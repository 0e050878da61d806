"""Token/expert alignment in Triton: the step's (token, choice) pairs sorted by
expert, in one launch.

The torch reference is `atom.model_ops.grouped_experts.align_to_experts`: a stable
argsort of the flat expert ids, per-expert counts, their running sum, the inverse
permutation and each sorted row's token, about eight kernels per MoE layer. Here one
program walks the ids in chunks: it counts the experts, then places each pair at its
expert's start plus the number of earlier pairs of that expert (the stable order).
Its work grows with pairs x experts, so it serves decode-sized steps; the
reference's caller sends larger ones to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import rows_per_chunk


@triton.jit
def _align_kernel(
    ids_ptr,
    token_of_ptr,
    position_ptr,
    group_ends_ptr,
    num_pairs,
    pairs_per_token,
    num_experts,
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
        tl.store(token_of_ptr + row, (first + pairs) // pairs_per_token, mask=inside)
        next_row += tl.sum(hits, axis=0)


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
    block_e = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](
        ids,
        token_of,
        position,
        group_ends,
        num_pairs,
        expert_ids.shape[-1],
        num_experts,
        BLOCK_N=rows_per_chunk(block_e),
        BLOCK_E=block_e,
    )
    return token_of, position, group_ends
