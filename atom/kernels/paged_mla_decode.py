"""Absorbed MLA decode / verify over the paged latent cache, in Triton.

The torch reference is `atom.model_ops.paged_mla.absorbed_attention` over the rows
`atom.model_ops.paged_cache.gather_kv` gathers. Here the key up-projection is already
folded into the query (q_latent = q_nope W_uk), and each program takes one query row
of one sequence for BLOCK_H heads (all heads share the latent row, as in multi-query
attention) and walks that sequence's visible rows through its block table: scores
against [c_kv | k_pe], an online softmax, and the probability-weighted sum of c_kv,
all accumulated in fp32. Only live rows are read, so the cost follows the context,
not the table width; long contexts are split over `num_splits` programs, each an
equal share of the row's visible rows (`context_splits.split_keys`), whose partial
sums `context_splits.combine` merges. The value up-projection stays outside
(one GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.context_splits import (
    combine,
    min_keys_per_split,
    num_splits_for,
    split_keys,
    store_partials,
)
from atom.kernels.paged_walk import key_slots, online_softmax_step
from atom.utils.arithmetic import ceil_div


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    q_pe_ptr,
    cache_ptr,
    table_ptr,
    position_ptr,
    acc_ptr,
    stats_ptr,
    heads,
    rows_per_seq,
    table_width,
    block_size,
    min_split_keys,
    scale,
    kv_scale,
    stride_q_row,
    stride_q_head,
    stride_pe_row,
    stride_pe_head,
    stride_cache_row,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    row = tl.program_id(0)  # sequence * rows_per_seq + query row
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = row // rows_per_seq
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    c_ok, r_ok = c < RANK, r < ROPE
    q = tl.load(
        q_ptr + row * stride_q_row + h[:, None] * stride_q_head + c[None, :],
        mask=h_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + row * stride_pe_row + h[:, None] * stride_pe_head + r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    # A query at position p sees the sequence's rows 0..p.
    visible = tl.load(position_ptr + row) + 1
    first, last = split_keys(visible, split, min_split_keys, BLOCK_N)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    for start in range(first, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < last
        slot = key_slots(table_ptr, seq, table_width, n, n_ok, block_size)
        base = cache_ptr + slot[:, None] * stride_cache_row
        c_kv = tl.load(base + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        k_pe = tl.load(
            base + RANK + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )
        if FP8_CACHE:
            # Stored as value / kv_scale in e4m3; the dots take the query's dtype.
            c_kv = (c_kv.to(tl.float32) * kv_scale).to(q.dtype)
            k_pe = (k_pe.to(tl.float32) * kv_scale).to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(c_kv), input_precision="ieee")
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(c_kv)) + tl.dot(q_pe, tl.trans(k_pe))
        scores = tl.where(n_ok[None, :], scores * scale, float("-inf"))
        m, total, acc = online_softmax_step(m, total, acc, scores, c_kv, IEEE)
    store_partials(
        acc_ptr, stats_ptr, row, split, heads, h, h_ok, c, c_ok, acc, m, total, RANK
    )


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: float,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """o_latent [B, Q, h, C] fp32 = softmax(q_latent c_kv^T + q_pe k_pe^T) c_kv over
    each query's visible cached rows. q_latent [B, Q, h, C], q_pe [B, Q, h, R] (last
    dims contiguous), kv_cache [blocks, block_size, C + R] in the model dtype or
    float8_e4m3fn (stored / kv_scale, `model_ops/paged_cache.py`), block_tables [B, W],
    query_positions [B, Q]: the row a query sits at (it sees rows 0..p)."""
    batch, rows, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if kv_cache.shape[-1] != rank + rope:
        raise ValueError(
            f"cache rows of {kv_cache.shape[-1]} do not hold c_kv {rank} + k_pe {rope}"
        )
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError("the paged cache must hold its blocks contiguously")
    q_latent = q_latent.reshape(batch * rows, heads, rank)
    q_pe = q_pe.reshape(batch * rows, heads, rope)
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        q_latent, q_pe = q_latent.contiguous(), q_pe.contiguous()
    q_pe = q_pe.to(q_latent.dtype)
    block_h = max(16, triton.next_power_of_2(min(heads, 64)))
    head_blocks = ceil_div(heads, block_h)
    block_size, width = kv_cache.shape[1], block_tables.shape[1]
    splits = num_splits_for(batch * rows * head_blocks, width * block_size, q_pe.device)
    acc = torch.empty(batch * rows, splits, heads, rank, device=q_pe.device)
    stats = torch.empty(batch * rows, splits, heads, 2, device=q_pe.device)
    ieee = q_latent.dtype == torch.float32
    _mla_decode_kernel[(batch * rows, head_blocks, splits)](
        q_latent,
        q_pe,
        kv_cache,
        block_tables,
        query_positions,
        acc,
        stats,
        heads,
        rows,
        width,
        block_size,
        min_keys_per_split(q_pe.device),
        scale,
        kv_scale,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(1),
        RANK=rank,
        ROPE=rope,
        BLOCK_C=triton.next_power_of_2(rank),
        BLOCK_R=triton.next_power_of_2(rope),
        BLOCK_H=block_h,
        BLOCK_N=16 if ieee else 32,
        IEEE=ieee,
        # Kernels import no model_ops: the fp8 cache dtype is spelled out here.
        FP8_CACHE=kv_cache.dtype == torch.float8_e4m3fn,
        num_stages=1,
    )
    return combine(acc, stats).view(batch, rows, heads, rank)
