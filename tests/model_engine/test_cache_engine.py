"""CacheEngine: binding, fork / save copies, verify commit, sizing."""

import pytest
import torch

from atom.config import Config
from atom.model_engine.cache_engine import CacheEngine
from atom.models.kimi.model import KimiK3ForConditionalGeneration

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model():
    # Shapes only: the caches do not need loaded weights.
    return KimiK3ForConditionalGeneration(Config(model="tiny-kimi-k3"))


def test_binds_every_layer(model):
    cache = CacheEngine([model], 10, BLOCK_SIZE, 3, 4, "cpu", torch.bfloat16)
    assert len(cache.kv_layers) == 4 and len(cache.state_layers) == 4
    # One scratch block and one scratch state slot follow the usable ones.
    assert (cache.scratch_kv_slot, cache.scratch_state_slot) == (10 * BLOCK_SIZE, 3)
    for layer in cache.kv_layers:
        assert tuple(layer.kv_cache.shape) == (11, BLOCK_SIZE, 48)
        assert layer.kv_cache.dtype == torch.bfloat16
    for layer in cache.state_layers:
        assert tuple(layer.conv_state.shape) == (4, 384, 3)
        assert layer.conv_state.dtype == torch.bfloat16
        assert tuple(layer.ssm_state.shape) == (4, 4, 32, 32)
        assert layer.ssm_state.dtype == torch.float32
        assert tuple(layer.ssm_snapshots.shape) == (4, 4, 4, 32, 32)
        assert tuple(layer.conv_snapshots.shape) == (4, 4, 384, 3)
    # Without speculation no snapshot buffers are allocated.
    cache = CacheEngine([model], 10, BLOCK_SIZE, 3, 0, "cpu", torch.float32)
    assert all(layer.ssm_snapshots is None for layer in cache.state_layers)


def test_copy_state_and_commit(model):
    cache = CacheEngine([model], 2, BLOCK_SIZE, 3, 4, "cpu", torch.float32)
    for n, layer in enumerate(cache.state_layers):
        layer.conv_state[0].fill_(n + 1)
        layer.ssm_state[0].fill_(-(n + 1))
        for row in range(4):
            layer.conv_snapshots[2, row].fill_(10 * row + n)
            layer.ssm_snapshots[2, row].fill_(-10 * row - n)
    cache.copy_states([0], [1])
    cache.commit([2], [3])
    for n, layer in enumerate(cache.state_layers):
        assert torch.equal(layer.conv_state[1], layer.conv_state[0])
        assert torch.equal(layer.ssm_state[1], layer.ssm_state[0])
        assert (layer.conv_state[2] == 20 + n).all()
        assert (layer.ssm_state[2] == -20 - n).all()
    with pytest.raises(ValueError, match=r"commit of \[5\] rows outside"):
        cache.commit([2], [5])
    with pytest.raises(ValueError, match=r"commit of \[0\] rows"):
        cache.commit([2], [0])
    with pytest.raises(ValueError, match=r"destination state slots \[3\]"):
        cache.copy_states([0], [3])


def test_many_slots_move_in_one_call(model):
    cache = CacheEngine([model], 2, BLOCK_SIZE, 4, 3, "cpu", torch.float32)
    for layer in cache.state_layers:
        for slot in range(4):
            layer.ssm_state[slot].fill_(slot)
            for row in range(3):
                layer.ssm_snapshots[slot, row].fill_(10 * slot + row)
    cache.copy_states([0, 1], [2, 3])
    cache.commit([0, 1], [3, 1])
    for layer in cache.state_layers:
        assert [float(layer.ssm_state[s].flatten()[0]) for s in range(4)] == [
            2.0,
            10.0,
            0.0,
            1.0,
        ]


def test_sizes(model):
    cache = CacheEngine([model], 0, BLOCK_SIZE, 0, 4, "cpu", torch.bfloat16)
    assert cache.kv_bytes_per_block() == 4 * BLOCK_SIZE * 48 * 2
    per_row = 384 * 3 * 2 + 4 * 32 * 32 * 4
    assert cache.state_bytes_per_slot() == 4 * 5 * per_row


def test_rejects_bad_sizes(model):
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        CacheEngine([model], 1, 0, 1, 0, "cpu", torch.float32)
    with pytest.raises(ValueError, match="num_state_slots must be >= 0"):
        CacheEngine([model], 1, BLOCK_SIZE, -1, 0, "cpu", torch.float32)


def test_an_fp8_kv_cache_holds_twice_the_bf16_blocks(model):
    """The paged rows shrink to one byte an element; KDA states keep their dtypes."""
    bf16 = CacheEngine([model], 2, BLOCK_SIZE, 3, 4, "cpu", torch.bfloat16)
    fp8 = CacheEngine(
        [model], 2, BLOCK_SIZE, 3, 4, "cpu", torch.bfloat16, torch.float8_e4m3fn
    )
    assert all(layer.kv_cache.dtype == torch.float8_e4m3fn for layer in fp8.kv_layers)
    assert bf16.kv_bytes_per_block() == 2 * fp8.kv_bytes_per_block()
    assert bf16.state_bytes_per_slot() == fp8.state_bytes_per_slot()
    budget = 1000 * bf16.kv_bytes_per_block()
    assert budget // fp8.kv_bytes_per_block() == 2000
