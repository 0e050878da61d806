"""DSpark's greedy Markov chain over the block's base logits, two launches a draft.

`spec_decode.markov_head.greedy_drafts` is the reference: for k = 1..T,
x_k = argmax(U_k + W1[x_{k-1}] W2^T) in fp32 (lowest index on ties). In torch each
position costs about eight small kernels (the row of W1, casts of it and of all of
W2, the product, the sum, the argmax, the store), all of them inside the block
pass's CUDA graph and all in sequence. Here a position is two launches: one program
per block of the vocabulary reads its W2 rows once, scores them for every sequence
and keeps the block's best (value, token); then one program per sequence picks the
best block, which is the draft the next position's scores start from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# W2 elements a scoring program keeps in registers (fp32).
_TILE = 8192
# Blocks' partial results a picking program compares at once.
_BLOCK_B = 1024


@triton.jit
def _markov_scores_kernel(
    base_ptr,
    prev_ptr,
    w1_ptr,
    w2_ptr,
    best_ptr,
    where_ptr,
    num_seqs,
    vocab,
    rank,
    num_blocks,
    stride_base,
    stride_prev,
    stride_w1,
    stride_w2,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    block = tl.program_id(0)
    v = block * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    v_ok, r_ok = v < vocab, r < rank
    w2 = tl.load(
        w2_ptr + v.to(tl.int64)[:, None] * stride_w2 + r[None, :],
        mask=v_ok[:, None] & r_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    for s in range(num_seqs):
        prev = tl.load(prev_ptr + s * stride_prev)
        w1 = tl.load(w1_ptr + prev * stride_w1 + r, r_ok, other=0.0).to(tl.float32)
        base = tl.load(base_ptr + s * stride_base + v, v_ok, other=0.0).to(tl.float32)
        z = tl.where(v_ok, base + tl.sum(w2 * w1[None, :], axis=1), float("-inf"))
        best = tl.max(z, axis=0)
        tl.store(best_ptr + s * num_blocks + block, best)
        tl.store(
            where_ptr + s * num_blocks + block, tl.min(tl.where(z == best, v, vocab))
        )


@triton.jit
def _markov_pick_kernel(
    best_ptr,
    where_ptr,
    out_ptr,
    num_blocks,
    vocab,
    stride_out,
    BLOCK_B: tl.constexpr,
):
    s = tl.program_id(0)
    chosen_value = tl.full([], float("-inf"), tl.float32)
    chosen = tl.full([], 0, tl.int32) + vocab
    # Blocks cover the vocabulary in order: an earlier block wins a tie.
    for start in range(0, num_blocks, BLOCK_B):
        blocks = start + tl.arange(0, BLOCK_B)
        ok = blocks < num_blocks
        values = tl.load(best_ptr + s * num_blocks + blocks, ok, other=float("-inf"))
        tokens = tl.load(where_ptr + s * num_blocks + blocks, ok, other=vocab)
        top = tl.max(values, axis=0)
        token = tl.min(tl.where(values == top, tokens, vocab), axis=0)
        better = top > chosen_value
        chosen = tl.where(better, token, chosen)
        chosen_value = tl.where(better, top, chosen_value)
    tl.store(out_ptr + s * stride_out, chosen)


def markov_greedy_drafts(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """[S, T] long: `greedy_drafts` of base_logits [S, T, V] after anchor_ids [S],
    with the Markov head's tables w1, w2 [V, r] (any float dtype; fp32 math)."""
    num_seqs, width, vocab = base_logits.shape
    rank = w1.shape[1]
    if tuple(w2.shape) != (vocab, rank) or w1.shape[0] != vocab:
        raise ValueError(
            f"the Markov tables must be [{vocab}, r], got {tuple(w1.shape)} and "
            f"{tuple(w2.shape)}"
        )
    if base_logits.stride(2) != 1 or w1.stride(1) != 1 or w2.stride(1) != 1:
        raise ValueError("base logits and Markov tables need contiguous last dims")
    device = base_logits.device
    drafts = torch.empty(num_seqs, width, dtype=torch.long, device=device)
    block_r = triton.next_power_of_2(rank)
    block_v = min(triton.next_power_of_2(vocab), max(16, _TILE // block_r))
    num_blocks = triton.cdiv(vocab, block_v)
    best = torch.empty(num_seqs, num_blocks, dtype=torch.float32, device=device)
    where = torch.empty(num_seqs, num_blocks, dtype=torch.int32, device=device)
    prev = anchor_ids
    for k in range(width):
        _markov_scores_kernel[(num_blocks,)](
            base_logits[:, k],
            prev,
            w1,
            w2,
            best,
            where,
            num_seqs,
            vocab,
            rank,
            num_blocks,
            base_logits.stride(0),
            prev.stride(0),
            w1.stride(0),
            w2.stride(0),
            BLOCK_V=block_v,
            BLOCK_R=block_r,
        )
        prev = drafts[:, k]
        _markov_pick_kernel[(num_seqs,)](
            best,
            where,
            prev,
            num_blocks,
            vocab,
            drafts.stride(0),
            BLOCK_B=min(_BLOCK_B, triton.next_power_of_2(num_blocks)),
        )
    return drafts
