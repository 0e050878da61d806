"""atom/kernels/paged_index_scores.py against `block_sparse.pooled_block_scores` over
the gathered index keys: the same scores, and so the same kept blocks."""

import pytest
import torch

from atom.kernels import triton_available
from atom.kernels.paged_index_scores import index_block_scores
from atom.model_ops.block_sparse import IndexerConfig, kept_blocks, pooled_block_scores
from atom.model_ops.paged_cache import gather_kv
from atom.model_ops.visibility import sequence_key_ends, sequence_visibility
from tests.kernels.devices import DEVICES, half_dtype
from tests.kernels.paged_helpers import (
    UNEVEN,
    poison_past_ends,
    random_cache,
    step,
)

pytestmark = pytest.mark.kernels

KV_HEADS, INDEX_DIM, INDEX_OFFSET = (
    2,
    32,
    24,
)  # the index key after 24 other elements of a row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [False, True])
# (sequences, rows each): decode and verify batches, and a non-uniform one whose
# padded rows sit past their sequence's end.
@pytest.mark.parametrize("batch, rows", [(1, 1), (1, 4), (3, 1), (3, 4), (3, UNEVEN)])
@pytest.mark.parametrize("sparse_block_size", [4, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_scores_and_kept_blocks_match_the_reference(
    device, half, batch, rows, sparse_block_size, fp8
):
    if not triton_available(device):
        pytest.skip("triton cannot run here")
    dtype = half_dtype(device) if half else torch.float32
    gen = torch.Generator(device=device).manual_seed(batch + 7 * len(str(rows)))
    metadata = step(device, rows, batch)
    kv_scale = 0.75 if fp8 else 1.0
    width = INDEX_OFFSET + INDEX_DIM
    cache = random_cache(gen, device, dtype, fp8, kv_scale, width)
    if rows == UNEVEN:
        # Large, not nan: a max over scores may pass a nan by.
        poison_past_ends(cache, 100.0)
    shape = (batch, metadata.max_query_len, KV_HEADS, INDEX_DIM)
    index_q = torch.randn(*shape, generator=gen, device=device).to(dtype)
    keys = gather_kv(cache, metadata.block_tables, kv_scale, dtype)[..., INDEX_OFFSET:]
    visible = sequence_visibility(metadata, keys.shape[1])
    expected = pooled_block_scores(index_q, keys, visible, sparse_block_size)
    got = index_block_scores(
        index_q,
        cache,
        kv_scale,
        metadata.block_tables,
        metadata.query_positions,
        sequence_key_ends(metadata),
        INDEX_OFFSET,
        sparse_block_size,
    )
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    indexer = IndexerConfig(KV_HEADS, INDEX_DIM, sparse_block_size, 2, 1, 1)
    positions = metadata.query_positions
    assert torch.equal(
        kept_blocks(got, positions, indexer), kept_blocks(expected, positions, indexer)
    )
