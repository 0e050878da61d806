"""atom/kernels/paged_gqa_decode.py (the triton GQA backend) against the torch
reference: `gqa_attention` over the gathered tables, masked by
`sequence_visibility` (and by kept sparse blocks)."""

import pytest
import torch

from atom.kernels import triton_available
from atom.kernels.paged_gqa_decode import gqa_decode
from atom.model_ops.attention_backend import (
    GQALayer,
    TorchGQABackend,
    TritonGQABackend,
    select_gqa_backend,
)
from atom.model_ops.block_sparse import IndexerConfig
from atom.model_ops.paged_attention import gqa_attention
from atom.model_ops.paged_cache import gather_kv
from atom.model_ops.visibility import sequence_key_ends, sequence_visibility
from atom.utils.arithmetic import ceil_div
from tests.kernels.devices import DEVICES, half_dtype
from tests.kernels.paged_helpers import (
    BLOCK_SIZE,
    TABLE_WIDTH,
    UNEVEN,
    poison_past_ends,
    random_cache,
    step,
)

pytestmark = pytest.mark.kernels

HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM = 8, 2, 16, 16
KV_WIDTH = KV_HEADS * HEAD_DIM
SCALE = 0.3


def reference(q, cache, kv_scale, metadata, keep=None, sparse_block_size=1):
    keys = gather_kv(cache, metadata.block_tables, kv_scale, q.dtype)
    visible = sequence_visibility(metadata, keys.shape[1]).unsqueeze(1)
    if keep is not None:
        per_key = keep.repeat_interleave(sparse_block_size, dim=-1)
        visible = visible & per_key[..., : keys.shape[1]]
    k, v = keys[..., :KV_WIDTH], keys[..., KV_WIDTH : 2 * KV_WIDTH]
    heads = (KV_HEADS, HEAD_DIM)
    return gqa_attention(
        q, k.unflatten(-1, heads), v.unflatten(-1, heads), visible, SCALE
    )


def decode(q, cache, kv_scale, metadata, keep=None, sparse_block_size=1):
    return gqa_decode(
        q,
        cache,
        kv_scale,
        metadata.block_tables,
        metadata.query_positions,
        sequence_key_ends(metadata),
        KV_HEADS,
        0,
        KV_WIDTH,
        SCALE,
        keep,
        sparse_block_size,
    )


def random_keep(gen, metadata, sparse_block_size):
    """A random choice of sparse blocks per KV group and row, each row's own block
    always kept (as the indexer forces it), so every row sees a key."""
    num_blocks = ceil_div(TABLE_WIDTH * BLOCK_SIZE, sparse_block_size)
    shape = (metadata.num_seqs, KV_HEADS, metadata.max_query_len, num_blocks)
    keep = torch.rand(shape, generator=gen, device=gen.device) < 0.5
    own = (metadata.query_positions // sparse_block_size).unsqueeze(1)
    return keep.scatter(-1, own.expand(-1, KV_HEADS, -1).unsqueeze(-1), True)


def skip_without_triton(device):
    if not triton_available(device):
        pytest.skip("triton cannot run here")


def tolerance(dtype):
    return {} if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_attends_as_the_reference(device, half, batch, rows):
    skip_without_triton(device)
    dtype = half_dtype(device) if half else torch.float32
    gen = torch.Generator(device=device).manual_seed(10 * batch + rows)
    metadata = step(device, rows, batch)
    cache = random_cache(gen, device, dtype, False, 1.0, 2 * KV_WIDTH + INDEX_DIM)
    q = torch.randn(batch, rows, HEADS, HEAD_DIM, generator=gen, device=device)
    q = q.to(dtype)
    expected = reference(q, cache, 1.0, metadata).float()
    torch.testing.assert_close(
        decode(q, cache, 1.0, metadata), expected, **tolerance(dtype)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_reads_an_fp8_cache(device, rows):
    skip_without_triton(device)
    dtype = half_dtype(device) if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(rows)
    metadata = step(device, rows)
    cache = random_cache(gen, device, dtype, True, 0.5, 2 * KV_WIDTH)
    q = torch.randn(3, rows, HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    expected = reference(q, cache, 0.5, metadata).float()
    torch.testing.assert_close(
        decode(q, cache, 0.5, metadata), expected, **tolerance(dtype)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 4])
# 4: blocks finer than a chunk (masked per key); 16: whole chunks skipped (fp32).
@pytest.mark.parametrize("sparse_block_size", [4, 16])
def test_decode_attends_only_to_kept_blocks(device, rows, sparse_block_size):
    skip_without_triton(device)
    gen = torch.Generator(device=device).manual_seed(rows + sparse_block_size)
    metadata = step(device, rows)
    cache = random_cache(gen, device, torch.float32, False, 1.0, 2 * KV_WIDTH)
    q = torch.randn(3, rows, HEADS, HEAD_DIM, generator=gen, device=device)
    keep = random_keep(gen, metadata, sparse_block_size)
    expected = reference(q, cache, 1.0, metadata, keep, sparse_block_size)
    dense = reference(q, cache, 1.0, metadata)
    assert not torch.allclose(expected, dense)  # the mask drops keys that matter
    got = decode(q, cache, 1.0, metadata, keep.to(torch.uint8), sparse_block_size)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_see_nothing_past_their_sequence(device):
    skip_without_triton(device)
    gen = torch.Generator(device=device).manual_seed(1)
    # The padded rows' positions run past their sequence's last row, whose stale
    # keys stay unseen.
    metadata = step(device, UNEVEN)
    cache = random_cache(gen, device, torch.float32, False, 1.0, 2 * KV_WIDTH)
    poison_past_ends(cache)
    q = torch.randn(3, 4, HEADS, HEAD_DIM, generator=gen, device=device)
    expected = reference(q, cache, 1.0, metadata)
    torch.testing.assert_close(decode(q, cache, 1.0, metadata), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_that_sees_nothing_gives_zeros(device):
    skip_without_triton(device)
    gen = torch.Generator(device=device).manual_seed(0)
    metadata = step(device, 2)
    cache = random_cache(gen, device, torch.float32, False, 1.0, 2 * KV_WIDTH)
    q = torch.randn(3, 2, HEADS, HEAD_DIM, generator=gen, device=device)
    keep = random_keep(gen, metadata, 4)
    keep[1, :, 0] = False  # sequence 1's first row keeps no block
    got = decode(q, cache, 1.0, metadata, keep, 4)
    assert torch.isfinite(got).all()
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))
    expected = reference(q, cache, 1.0, metadata, keep, 4)
    torch.testing.assert_close(got[:, 1], expected[:, 1])


INDEXER = IndexerConfig(
    num_heads=KV_HEADS,
    head_dim=INDEX_DIM,
    block_size=4,
    topk_blocks=2,
    local_blocks=1,
    init_blocks=1,
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 4, UNEVEN])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_backend_attends_as_the_torch_backend(device, rows, sparse, fp8):
    skip_without_triton(device)
    dtype = half_dtype(device) if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(len(str(rows)) + 2 * sparse)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    metadata = step(device, rows)
    indexer = INDEXER if sparse else None
    width = 2 * KV_WIDTH + (INDEX_DIM if sparse else 0)
    kv_scale = 0.5 if fp8 else 1.0
    cache = random_cache(gen, device, dtype, fp8, kv_scale, width)
    tokens = metadata.num_tokens
    q, new_rows = randn(tokens, HEADS, HEAD_DIM), randn(tokens, width)
    index_q = randn(tokens, KV_HEADS, INDEX_DIM) if sparse else None
    triton = select_gqa_backend(device, "triton")
    assert isinstance(triton, TritonGQABackend)
    caches = [cache.clone(), cache.clone()]
    outputs = [
        backend.forward(
            q,
            new_rows,
            index_q,
            GQALayer(c, kv_scale, KV_HEADS, HEAD_DIM, SCALE, indexer),
            metadata,
        ).float()
        for backend, c in zip((triton, TorchGQABackend()), caches)
    ]
    # Both wrote this step's rows to the same slots.
    assert torch.equal(caches[0].float().nan_to_num(), caches[1].float().nan_to_num())
    torch.testing.assert_close(outputs[0], outputs[1], **tolerance(dtype))


def test_backend_choice():
    assert select_gqa_backend("cpu").name == "torch"
    assert select_gqa_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="auto"):
        select_gqa_backend("cpu", "flash")
