"""Splitting a paged-attention context over several programs, and merging them.

The decode kernels (`paged_mla_decode.py`, `paged_gqa_decode.py`) give each query
row's context to `num_splits` programs when the grid would otherwise leave the GPU
idle; each program runs an online softmax over its keys and writes its partial sum
with (running max, sum of exponentials) through `store_partials`, and `combine`
merges them into one softmax.
The split count is a host fact (graph-stable): it depends on shapes only.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from atom.utils.arithmetic import ceil_div

# Keys per split below which a context is not split further (on a GPU).
_MIN_KEYS_PER_SPLIT = 256
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
    units = _multiprocessors(device)
    wanted = ceil_div(2 * units, max(1, programs))
    floor = min_keys_per_split(device)
    return max(1, min(wanted, ceil_div(max_keys, floor), _SPLIT_CAP))


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def combine(acc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Merge split partial sums: acc [N, S, h, C], stats [N, S, h, 2] (running max,
    sum of exponentials) -> the softmax-weighted sum [N, h, C] fp32. A row no split
    saw a key for (every max -inf) comes out as zeros, not nan."""
    m, total = stats.unbind(-1)
    best = m.amax(dim=1, keepdim=True)
    weight = torch.where(m == float("-inf"), 0.0, torch.exp(m - best))
    o = (acc * weight.unsqueeze(-1)).sum(dim=1)
    denominator = (total * weight).sum(dim=1)
    return o / torch.where(denominator > 0, denominator, 1.0).unsqueeze(-1)


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
