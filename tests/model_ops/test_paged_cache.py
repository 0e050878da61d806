"""atom/model_ops/paged_cache.py: rows written to an fp8 cache read back within
e4m3's rounding, at the slots they were written to."""

import pytest
import torch

from atom.config import Config
from atom.model_ops.paged_cache import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    gather_kv,
    read_back_kv,
    resolve_kv_cache_dtype,
    write_kv,
)

BLOCKS, BLOCK_SIZE, WIDTH = 6, 4, 24


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp8_rows_read_back_within_e4m3_rounding(scale):
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, WIDTH, dtype=FP8_KV_DTYPE)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, WIDTH, generator=gen, dtype=torch.float32) * 3
    rows[0, 0] = 1000.0 * scale  # beyond e4m3's range: saturates, not inf / nan
    slots = torch.tensor([1, 6, 7, 12, 22])
    write_kv(cache, slots, rows, scale)
    tables = torch.tensor([[1, 3, 5], [0, 2, 4]])
    gathered = gather_kv(cache, tables, scale, torch.bfloat16)
    assert gathered.dtype == torch.bfloat16 and gathered.shape == (2, 12, WIDTH)
    flat = gathered.view(-1, 3, BLOCK_SIZE, WIDTH)  # [seq, table entry, offset]
    by_slot = {1: flat[1, 0, 1], 6: flat[0, 0, 2], 7: flat[0, 0, 3]}
    by_slot |= {12: flat[0, 1, 0], 22: flat[0, 2, 2]}
    read = torch.stack([by_slot[int(s)] for s in slots]).float()
    expected = rows.clone()
    expected[0, 0] = FP8_KV_MAX * scale
    # 3 mantissa bits: half a step is 2^-4 of a normal value; subnormals (below
    # 2^-6 * scale) round to steps of 2^-9 * scale. bf16 output adds 2^-9.
    bound = torch.maximum(
        expected.abs() * (2**-4 + 2**-8), torch.tensor(2**-10 * scale)
    )
    assert ((read - expected).abs() <= bound).all()
    # What a forward attends to for rows it never reads from the cache is the same.
    torch.testing.assert_close(
        read_back_kv(rows, cache, scale, torch.bfloat16).float(), read, rtol=0, atol=0
    )
    # Slots nobody wrote stay zero.
    assert flat[1, 1].float().abs().sum() == 0


def test_a_model_dtype_cache_stores_rows_as_they_are():
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, WIDTH, dtype=torch.bfloat16)
    rows = torch.randn(2, WIDTH, dtype=torch.bfloat16)
    write_kv(cache, torch.tensor([0, 5]), rows, 1.0)
    gathered = gather_kv(cache, torch.tensor([[0, 1]]), 1.0, torch.bfloat16)
    assert torch.equal(gathered[0, [0, 5]], rows)


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", "cpu") is None
    assert resolve_kv_cache_dtype("fp8", "cpu") is resolve_kv_cache_dtype(
        "fp8_e4m3", "cpu"
    )
    assert resolve_kv_cache_dtype("fp8", "cpu") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="allowed: auto, fp8, fp8_e4m3"):
        resolve_kv_cache_dtype("fp16", "cpu")


def test_the_engine_config_refuses_an_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match="'int8' is not supported; allowed: auto, fp8"):
        Config(model="tiny-kimi-k3", kv_cache_dtype="int8")
