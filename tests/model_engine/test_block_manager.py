import struct

import pytest
import xxhash

from atom.model_engine.block_manager import BlockManager, hash_block
from atom.model_engine.sequence import Sequence


def reference_hash(parent: int | None, tokens: list[int]) -> int:
    data = b"" if parent is None else struct.pack("<Q", parent)
    return xxhash.xxh64_intdigest(data + struct.pack(f"<{len(tokens)}i", *tokens))


def computed(seq: Sequence, bm: BlockManager) -> Sequence:
    """Pretend the prefill ran: register every full block."""
    bm.cache_full_blocks(seq, seq.num_tokens)
    return seq


def test_hash_recipe_is_xxh64_over_parent_then_int32_tokens():
    first = hash_block(None, [1, 2, 70000, 4])
    assert first == reference_hash(None, [1, 2, 70000, 4])
    second = hash_block(first, [5, 6, 7, 8])
    assert second == reference_hash(first, [5, 6, 7, 8])
    assert second != hash_block(None, [5, 6, 7, 8])


def test_allocate_and_deallocate_track_refcounts_and_free_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = Sequence(list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_total_blocks) == (3, 5, 8)
    assert bm.usage == pytest.approx(3 / 8)
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8


def test_lookahead_tokens_get_blocks_up_front():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = Sequence(list(range(8)))
    bm.allocate(seq, num_lookahead_tokens=3)
    assert len(seq.block_table) == 3  # positions 0..10


def test_can_allocate_refuses_when_blocks_run_out():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    bm.allocate(Sequence(list(range(12))))
    big = Sequence(list(range(8)))
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(big)


def test_prefix_hit_covers_only_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence(list(range(10)))
    bm.allocate(first)
    computed(first, bm)
    second = Sequence(list(range(10)) + [99, 98])
    bm.allocate(second)
    # Tokens 8 and 9 are in a partial block: not reusable.
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert bm.blocks[first.block_table[0]].ref_count == 2
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (22, 8)


def test_full_hit_is_cut_back_so_one_token_is_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence(list(range(8)))
    bm.allocate(first)
    computed(first, bm)
    same = Sequence(list(range(8)))
    assert bm.num_cached_prefix_blocks(same) == 1
    bm.allocate(same)
    assert same.num_cached_tokens == 4


def test_divergent_tokens_stop_the_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence(list(range(12)) + [0])
    bm.allocate(first)
    computed(first, bm)
    other = Sequence([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 0])
    assert bm.num_cached_prefix_blocks(other) == 1


def test_freed_block_keeps_its_hash_until_reused():
    evicted = []
    bm = BlockManager(num_blocks=3, block_size=4, on_hash_evicted=evicted.append)
    first = Sequence(list(range(5)))
    bm.allocate(first)
    computed(first, bm)
    bm.deallocate(first)
    again = Sequence(list(range(5)))
    assert bm.num_cached_prefix_blocks(again) == 1
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_cached_tokens == 4 and bm.num_free_blocks == 1
    bm.deallocate(again)
    # Fill the whole cache with other tokens: the hashed block is handed out again.
    filler = Sequence([50 + i for i in range(12)])
    bm.allocate(filler)
    assert evicted == [hash_block(None, [0, 1, 2, 3])]
    assert bm.num_cached_prefix_blocks(Sequence(list(range(5)))) == 0


def test_hits_on_blocks_in_use_need_no_free_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = Sequence(list(range(9)))
    bm.allocate(first)
    computed(first, bm)
    assert bm.num_free_blocks == 1
    # Two shared blocks plus one new block: fits in the single free block.
    assert bm.can_allocate(Sequence(list(range(9))))
    assert not bm.can_allocate(Sequence(list(range(9))), num_cached_blocks=0)
    assert not bm.can_allocate(Sequence([7] * 9))


def test_caller_may_shorten_the_hit_but_not_extend_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence(list(range(13)))
    bm.allocate(first)
    computed(first, bm)
    shorter = Sequence(list(range(13)))
    bm.allocate(shorter, num_cached_blocks=1)
    assert shorter.num_cached_tokens == 4
    with pytest.raises(ValueError, match="num_cached_blocks=4"):
        bm.allocate(Sequence(list(range(13))), num_cached_blocks=4)


def test_try_append_grows_for_speculative_rows_and_hashes_committed_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = Sequence(list(range(7)))
    bm.allocate(seq)
    bm.cache_full_blocks(seq, 7)
    assert seq.num_hashed_blocks == 1
    seq.token_ids.append(7)
    # Rows [last, d1..d5] at positions 7..12 need 4 blocks.
    assert bm.try_append(seq, 5)
    assert len(seq.block_table) == 4
    # Block 1 (tokens 4..7) is now fully committed; blocks 2, 3 hold drafts only.
    assert seq.num_hashed_blocks == 2
    assert bm.blocks[seq.block_table[2]].hash is None
    assert bm.try_append(seq, 0)  # never shrinks
    assert len(seq.block_table) == 4
    # Too few free blocks: nothing changes.
    free = bm.num_free_blocks
    assert not bm.try_append(seq, 4 * (free + 4))
    assert len(seq.block_table) == 4 and bm.num_free_blocks == free


def test_cache_full_blocks_registers_only_given_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = Sequence(list(range(16)))
    bm.allocate(seq)
    bm.cache_full_blocks(seq, 9)  # one chunk of 9 tokens ran
    assert seq.num_hashed_blocks == 2
    probe = Sequence(list(range(16)))
    assert bm.num_cached_prefix_blocks(probe) == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = Sequence(list(range(9)))
    bm.allocate(first)
    bm.cache_full_blocks(first, 9)
    second = Sequence(list(range(9)))
    bm.allocate(second)
    assert second.num_cached_tokens == 0
    assert set(first.block_table).isdisjoint(second.block_table)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
