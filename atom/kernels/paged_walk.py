"""How the paged decode kernels walk a sequence's keys, as Triton device functions.

`paged_mla_decode.py`, `paged_gqa_decode.py` and `paged_index_scores.py` each read a
sequence's keys chunk by chunk through its block table and, for attention, fold
every chunk into an online softmax. The two steps they share live here once:
`key_slots` (the cache slot of key n) and `online_softmax_step`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_slots(table_ptr, seq, table_width, n, n_ok, block_size):
    """int64 cache slots of keys n of sequence `seq` through its block-table row
    (masked lanes read block 0, which the caller never uses)."""
    block = tl.load(
        table_ptr + seq.to(tl.int64) * table_width + n // block_size,
        mask=n_ok,
        other=0,
    )
    return block.to(tl.int64) * block_size + n % block_size


@triton.jit
def online_softmax_step(m, total, acc, scores, values, IEEE: tl.constexpr):
    """Fold one chunk into each query row's running max `m`, sum of exponentials
    `total` and weighted sum `acc` (all fp32): scores [R, N] fp32, -inf where the
    row does not see the key; values [N, C]. Returns the new (m, total, acc)."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A row that has seen no key yet keeps m = -inf, and exp(-inf - -inf) would be
    # nan: such a row rescales by 1 and takes nothing from the chunk.
    unseen = m_new == float("-inf")
    rescale = tl.where(unseen, 1.0, tl.exp(m - m_new))
    p = tl.where(unseen[:, None], 0.0, tl.exp(scores - m_new[:, None]))
    total = total * rescale + tl.sum(p, axis=1)
    if IEEE:
        update = tl.dot(p, values.to(tl.float32), input_precision="ieee")
    else:
        update = tl.dot(p.to(values.dtype), values)
    return m_new, total, acc * rescale[:, None] + update
