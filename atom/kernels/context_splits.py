"""Splitting a paged-attention context over several programs, and merging them.

The decode kernels (`paged_mla_decode.py`, `paged_gqa_decode.py`) give each query
row's context to `num_splits` programs when the grid would otherwise leave the GPU
idle; each program runs an online softmax over its keys and writes its partial sum
with (running max, sum of exponentials) through `store_partials`, and `combine`
merges them into one softmax (`combine_reference` is its torch form).
The split count is a host fact (graph-stable): it depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import multiprocessors
from atom.utils.arithmetic import ceil_div

# Keys per split below which a context is not split further (on a GPU): one
# BLOCK_N step of the MLA kernel, so a short context at a small batch spreads over
# many programs instead of walking its keys serially in one or two.
_MIN_KEYS_PER_SPLIT = 32
_SPLIT_CAP = 16


def min_keys_per_split(device: torch.device) -> int:
    """The fewest keys worth a split of their own: `_MIN_KEYS_PER_SPLIT` on a GPU;
    1 under the interpreter, so the tests' short contexts split and merge."""
    return _MIN_KEYS_PER_SPLIT if device.type == "cuda" else 1


def num_splits_for(programs: int, max_keys: int, device: torch.device) -> int:
    """Splits of each context so the grid fills the GPU about twice over, never
    below `min_keys_per_split` keys a split. Host facts only (graph-stable)."""
    if device.type != "cuda":
        return min(2, max_keys)  # the interpreter (tests): exercise the merge
    units = multiprocessors(device)
    wanted = ceil_div(2 * units, max(1, programs))
    floor = min_keys_per_split(device)
    return max(1, min(wanted, ceil_div(max_keys, floor), _SPLIT_CAP))


def combine_reference(acc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Merge split partial sums: acc [N, S, h, C], stats [N, S, h, 2] (running max,
    sum of exponentials) -> the softmax-weighted sum [N, h, C] fp32. A row no split
    saw a key for (every max -inf) comes out as zeros, not nan. `combine`'s torch
    reference."""
    m, total = stats.unbind(-1)
    best = m.amax(dim=1, keepdim=True)
    weight = torch.where(m == float("-inf"), 0.0, torch.exp(m - best))
    o = (acc * weight.unsqueeze(-1)).sum(dim=1)
    denominator = (total * weight).sum(dim=1)
    return o / torch.where(denominator > 0, denominator, 1.0).unsqueeze(-1)


@triton.jit
def _combine_kernel(
    acc_ptr,
    stats_ptr,
    out_ptr,
    splits,
    heads,
    WIDTH,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # One program per (row, head): its splits' partial sums merge in registers.
    row_head = tl.program_id(0)
    row, h = row_head // heads, row_head % heads
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_C)
    s_ok, c_ok = s < splits, c < WIDTH
    part = (row * splits + s) * heads + h  # [BLOCK_S] rows of acc / stats
    m = tl.load(stats_ptr + part * 2, mask=s_ok, other=float("-inf"))
    total = tl.load(stats_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    best = tl.max(m, axis=0)
    # Splits that saw no key (max -inf) weigh nothing; so does a row without keys.
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - best))
    acc = tl.load(
        acc_ptr + part[:, None] * WIDTH + c[None, :],
        mask=s_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    o = tl.sum(acc * weight[:, None], axis=0)
    denominator = tl.sum(total * weight, axis=0)
    denominator = tl.where(denominator > 0, denominator, 1.0)
    tl.store(out_ptr + row_head * WIDTH + c, o / denominator, mask=c_ok)


def combine(acc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """`combine_reference` in one launch (its torch form takes about fifteen small
    kernels, more than a short context's attention itself on a GPU)."""
    rows, splits, heads, width = acc.shape
    out = torch.empty(rows, heads, width, device=acc.device)
    _combine_kernel[(rows * heads,)](
        acc,
        stats,
        out,
        splits,
        heads,
        width,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_C=triton.next_power_of_2(width),
    )
    return out


@triton.jit
def split_keys(visible, split, min_split_keys, BLOCK_N: tl.constexpr):
    """Keys [first, last) of this split (program axis 2) out of a row's `visible`
    keys: the splits share the keys the row sees (not the table's width) in equal
    whole chunks of BLOCK_N, none below `min_split_keys` (`min_keys_per_split`)."""
    share = tl.maximum(tl.cdiv(visible, tl.num_programs(2)), min_split_keys)
    share = tl.cdiv(share, BLOCK_N) * BLOCK_N
    first = split * share
    return first, tl.minimum(first + share, visible)


@triton.jit
def store_partials(
    acc_ptr, stats_ptr, row, split, heads, h, h_ok, cols, cols_ok, acc, m, total, WIDTH
):
    """Write one split's partial sums acc [H, C] of query row `row`'s heads h, and
    their (running max, sum of exponentials), where `combine` reads them: acc
    [rows, splits, heads, WIDTH], stats [rows, splits, heads, 2]."""
    out = (row * tl.num_programs(2) + split) * heads + h
    tl.store(
        acc_ptr + out[:, None] * WIDTH + cols[None, :],
        acc,
        mask=h_ok[:, None] & cols_ok[None, :],
    )
    tl.store(stats_ptr + out * 2, m, mask=h_ok)
    tl.store(stats_ptr + out * 2 + 1, total, mask=h_ok)
