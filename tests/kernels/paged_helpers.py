"""What the paged-attention kernel tests share: a batch of sequences with cached
rows behind wide block tables, and random paged caches."""

import torch

from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_ops.paged_cache import FP8_KV_DTYPE

BLOCK_SIZE, NUM_BLOCKS, TABLE_WIDTH = 4, 40, 12
# Every sequence has cached rows (decode, verify); the longest splits its context.
CONTEXTS = [5, 17, 30]
TABLES = [[3, 9, 5], [1, 4, 22, 8, 30, 31], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


# Rows per sequence of a non-uniform batch: padded rows follow sequences 0 and 2,
# their positions past their sequence's last row.
UNEVEN = [1, 4, 2]


def poison_past_ends(cache, value=float("nan")):
    """`value` in the stale rows just past each sequence of `step(device, UNEVEN)`:
    keys 6.. of sequence 0 (blocks 9 and 5), keys 32.. of sequence 2 (block 18)."""
    cache[9, 2:] = cache[5] = cache[18] = value


def step(device, rows, batch=3):
    """Metadata of the last `batch` sequences with `rows` rows each (an int) or
    rows[i] rows for sequence i (a list: a non-uniform batch)."""
    counts = rows if isinstance(rows, list) else [rows] * batch
    seqs = list(zip(CONTEXTS, TABLES))[-len(counts) :]
    works = [
        SeqWork(
            seq_id=i,
            token_ids=[1] * n,
            context_len=context,
            block_table=table,
            state_slot=i,
            num_drafts=n - 1,
        )
        for i, (n, (context, table)) in enumerate(zip(counts, seqs))
    ]
    # A wide table, as a captured graph fixes it: rows past each context are stale.
    return prepare_inputs(works, BLOCK_SIZE, device, table_width=TABLE_WIDTH)[2]


def random_cache(gen, device, dtype, fp8: bool, kv_scale: float, width: int):
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, width, generator=gen, device=device)
    # Block 0 pads the tables and block 2 is nobody's: neither may be read.
    cache[0] = cache[2] = float("nan")
    if fp8:
        # An fp8 cache holds value / kv_scale; both paths read it back * kv_scale.
        return (cache / kv_scale).to(FP8_KV_DTYPE)
    return cache.to(dtype)
