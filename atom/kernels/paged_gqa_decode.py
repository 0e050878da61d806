"""Grouped-query attention decode / verify over the paged KV cache, in Triton.

The torch reference is `atom.model_ops.paged_attention.gqa_attention` over the rows
`atom.model_ops.paged_cache.gather_kv` gathers, masked by
`atom.model_ops.visibility.sequence_visibility` (and, on block-sparse layers, by the
kept blocks of `atom.model_ops.block_sparse`). That path gathers the whole block
table, so its cost grows with `max_model_len`; here each program takes one query
row of one sequence for the query heads of one KV head (padded to BLOCK_G >= 16
rows for `tl.dot`) and walks only the sequence's visible keys through its block
table: key n is visible iff n <= the row's position and n < the sequence's key end
(its cached rows plus this forward's). Scores, an online softmax and the
probability-weighted sum of values are accumulated in fp32. A cache row is
[k (kv_heads * d) | v (kv_heads * d) | ...]; an fp8 e4m3 cache holds value /
kv_scale. With a keep mask (the indexer's kept blocks per KV group and query row)
a chunk of BLOCK_N keys none of whose sparse blocks is kept is skipped, neither
read nor computed. Long contexts are split over `num_splits` programs, each taking
an equal share of its row's visible keys (decided in the kernel, no host sync), and
`context_splits.combine` merges their partial sums.
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


@triton.jit
def _gqa_decode_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    position_ptr,
    key_end_ptr,
    keep_ptr,
    acc_ptr,
    stats_ptr,
    heads,
    group,
    rows_per_seq,
    table_width,
    block_size,
    sparse_block_size,
    min_split_keys,
    k_offset,
    v_offset,
    scale,
    kv_scale,
    stride_q_row,
    stride_q_head,
    stride_cache_row,
    stride_keep_seq,
    stride_keep_group,
    stride_keep_row,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    SPARSE: tl.constexpr,
):
    row = tl.program_id(0)  # sequence * rows_per_seq + query row
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = row // rows_per_seq
    j = tl.arange(0, BLOCK_G)
    h = kv_head * group + j  # the query heads of this KV head's group
    h_ok = j < group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + row * stride_q_row + h[:, None] * stride_q_head + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # Keys 0..visible-1: up to the row's own position, never past the sequence's end.
    visible = tl.minimum(tl.load(position_ptr + row) + 1, tl.load(key_end_ptr + seq))
    first, last = split_keys(visible, split, min_split_keys, BLOCK_N)
    if SPARSE:
        keep_row = (
            keep_ptr
            + seq.to(tl.int64) * stride_keep_seq
            + kv_head * stride_keep_group
            + (row % rows_per_seq) * stride_keep_row
        )
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(first, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < last
        take = True
        if SPARSE:
            kept = tl.load(keep_row + n // sparse_block_size, mask=n_ok, other=0)
            n_ok = n_ok & (kept != 0)
            # Skip a chunk whose sparse blocks are all dropped: no load, no dot.
            take = tl.max(n_ok.to(tl.int32), axis=0) > 0
        if take:
            slot = key_slots(table_ptr, seq, table_width, n, n_ok, block_size)
            base = cache_ptr + slot[:, None] * stride_cache_row + kv_head * HEAD_DIM
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(base + k_offset + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(base + v_offset + d[None, :], mask=kv_mask, other=0.0)
            if FP8_CACHE:
                # Stored as value / kv_scale in e4m3; the dots take q's dtype.
                k = (k.to(tl.float32) * kv_scale).to(q.dtype)
                v = (v.to(tl.float32) * kv_scale).to(q.dtype)
            else:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(n_ok[None, :], scores * scale, float("-inf"))
            m, total, acc = online_softmax_step(m, total, acc, scores, v, IEEE)
    store_partials(
        acc_ptr, stats_ptr, row, split, heads, h, h_ok, d, d_ok, acc, m, total, HEAD_DIM
    )


def gqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: float,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    key_ends: torch.Tensor,
    num_kv_heads: int,
    k_offset: int,
    v_offset: int,
    scale: float,
    keep: torch.Tensor | None = None,
    sparse_block_size: int = 1,
) -> torch.Tensor:
    """o [B, Q, hq, d] fp32 = softmax(q k^T * scale) v per query head over its KV
    group's visible cached keys. q [B, Q, hq, d] (last dim contiguous); kv_cache
    [blocks, block_size, row_width] in the model dtype or float8_e4m3fn (stored /
    kv_scale, `model_ops/paged_cache.py`), head g's keys at k_offset + g * d of a
    row and its values at v_offset + g * d; block_tables [B, W]; query_positions
    [B, Q]; key_ends [B]: keys at index >= key_end are never visible (cached rows
    plus this forward's). keep [B, hkv, Q, num_sparse_blocks] bool or uint8: key n
    is attended only where keep[..., n // sparse_block_size] (block-sparse layers).
    """
    batch, rows, heads, head_dim = q.shape
    if heads % num_kv_heads:
        raise ValueError(f"{heads} query heads do not group over {num_kv_heads}")
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError("the paged cache must hold its blocks contiguously")
    if max(k_offset, v_offset) + num_kv_heads * head_dim > kv_cache.shape[-1]:
        raise ValueError(
            f"cache rows of {kv_cache.shape[-1]} do not hold {num_kv_heads} heads of "
            f"{head_dim} at offsets {k_offset} and {v_offset}"
        )
    q = q.reshape(batch * rows, heads, head_dim)
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // num_kv_heads
    block_size, width = kv_cache.shape[1], block_tables.shape[1]
    device = q.device
    splits = num_splits_for(batch * rows * num_kv_heads, width * block_size, device)
    acc = torch.empty(batch * rows, splits, heads, head_dim, device=device)
    stats = torch.empty(batch * rows, splits, heads, 2, device=device)
    sparse = keep is not None
    if sparse:
        if keep.shape[:3] != (batch, num_kv_heads, rows):
            raise ValueError(
                f"keep {tuple(keep.shape)} is not [{batch}, {num_kv_heads}, {rows}, "
                "blocks]"
            )
        if keep.dtype == torch.bool:
            keep = keep.view(torch.uint8)
        if keep.stride(-1) != 1:
            keep = keep.contiguous()
    else:
        keep = stats  # never read
    keep_strides = keep.stride()[:3] if sparse else (0, 0, 0)
    ieee = q.dtype == torch.float32
    _gqa_decode_kernel[(batch * rows, num_kv_heads, splits)](
        q,
        kv_cache,
        block_tables,
        query_positions,
        key_ends,
        keep,
        acc,
        stats,
        heads,
        group,
        rows,
        width,
        block_size,
        sparse_block_size,
        min_keys_per_split(device),
        k_offset,
        v_offset,
        scale,
        kv_scale,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(1),
        *keep_strides,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=16 if ieee else 64,
        IEEE=ieee,
        # Kernels import no model_ops: the fp8 cache dtype is spelled out here.
        FP8_CACHE=kv_cache.dtype == torch.float8_e4m3fn,
        SPARSE=sparse,
        num_stages=1,
    )
    return combine(acc, stats).view(batch, rows, heads, head_dim)
