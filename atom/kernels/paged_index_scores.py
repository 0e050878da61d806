"""The lightning indexer's pooled block scores over the paged cache, in Triton.

The torch reference is `atom.model_ops.block_sparse.pooled_block_scores` over the
index keys `atom.model_ops.paged_cache.gather_kv` gathers (the last `index_dim`
elements of each cache row), masked by `visibility.sequence_visibility`: for each
query row and index head g, the best score iq_g . ik_n over the visible keys n of
each sparse block (-inf for a block with none). That path gathers and scores the
whole block table; here one program takes one query row and one sparse block for
every index head (padded to BLOCK_G >= 16 rows for `tl.dot`), reads only the
block's visible index keys through the block table and writes -inf, reading
nothing, for blocks past the row's last visible key. Scores accumulate in fp32:
fp32 inputs take IEEE dots, bf16 / fp16 ones exact products with fp32 sums, so
the block choice (`block_sparse.kept_blocks`, on top) matches the reference's.
An fp8 e4m3 cache holds value / kv_scale, read back in the query's dtype as
`paged_cache.decode_kv` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.paged_walk import key_slots
from atom.utils.arithmetic import ceil_div


@triton.jit
def _index_scores_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    position_ptr,
    key_end_ptr,
    out_ptr,
    groups,
    rows_per_seq,
    table_width,
    block_size,
    sparse_block_size,
    index_offset,
    kv_scale,
    stride_q_row,
    stride_q_head,
    stride_cache_row,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    row = tl.program_id(0)  # sequence * rows_per_seq + query row
    sparse_block = tl.program_id(1)
    num_blocks = tl.num_programs(1)
    seq = row // rows_per_seq
    g = tl.arange(0, BLOCK_G)
    g_ok = g < groups
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    visible = tl.minimum(tl.load(position_ptr + row) + 1, tl.load(key_end_ptr + seq))
    first = sparse_block * sparse_block_size
    last = tl.minimum(first + sparse_block_size, visible)
    best = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    if first < last:
        q = tl.load(
            q_ptr + row * stride_q_row + g[:, None] * stride_q_head + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        for start in range(first, last, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < last
            slot = key_slots(table_ptr, seq, table_width, n, n_ok, block_size)
            k = tl.load(
                cache_ptr
                + slot[:, None] * stride_cache_row
                + index_offset
                + d[None, :],
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            if FP8_CACHE:
                k = (k.to(tl.float32) * kv_scale).to(q.dtype)
            else:
                k = k.to(q.dtype)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            best = tl.maximum(best, tl.max(scores, axis=1))
    out = ((seq * groups + g) * rows_per_seq + row % rows_per_seq) * num_blocks
    tl.store(out_ptr + out + sparse_block, best, mask=g_ok)


def index_block_scores(
    index_q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: float,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    key_ends: torch.Tensor,
    index_offset: int,
    sparse_block_size: int,
) -> torch.Tensor:
    """[B, G, Q, num_blocks] fp32: each sparse block's best visible index score
    (-inf when it holds no visible key), num_blocks = ceil(W * block_size /
    sparse_block_size). index_q [B, Q, G, D] (last dim contiguous); kv_cache [blocks,
    block_size, row_width] with the index key at index_offset..index_offset+D of a
    row (model dtype, or float8_e4m3fn stored / kv_scale); block_tables [B, W];
    query_positions [B, Q]; key_ends [B]: keys at index >= key_end are never visible.
    """
    batch, rows, groups, dim = index_q.shape
    if index_offset + dim > kv_cache.shape[-1]:
        raise ValueError(
            f"cache rows of {kv_cache.shape[-1]} do not hold an index key of {dim} "
            f"at {index_offset}"
        )
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError("the paged cache must hold its blocks contiguously")
    index_q = index_q.reshape(batch * rows, groups, dim)
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    block_size, width = kv_cache.shape[1], block_tables.shape[1]
    num_blocks = ceil_div(width * block_size, sparse_block_size)
    out = torch.empty(batch, groups, rows, num_blocks, device=index_q.device)
    ieee = index_q.dtype == torch.float32
    _index_scores_kernel[(batch * rows, num_blocks)](
        index_q,
        kv_cache,
        block_tables,
        query_positions,
        key_ends,
        out,
        groups,
        rows,
        width,
        block_size,
        sparse_block_size,
        index_offset,
        kv_scale,
        index_q.stride(0),
        index_q.stride(1),
        kv_cache.stride(1),
        DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_G=max(16, triton.next_power_of_2(groups)),
        BLOCK_N=min(64, max(16, triton.next_power_of_2(sparse_block_size))),
        IEEE=ieee,
        # Kernels import no model_ops: the fp8 cache dtype is spelled out here.
        FP8_CACHE=kv_cache.dtype == torch.float8_e4m3fn,
        num_stages=1,
    )
    return out
