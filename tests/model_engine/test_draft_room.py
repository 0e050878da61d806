"""EngineLimits.check_draft_room: too many drafts for the cache are refused by name,
with the largest count that fits."""

import re

import pytest

from atom.config import EngineLimits

BLOCK_BYTES = 100
ROW_BYTES = 1000


def limits(drafts: int) -> EngineLimits:
    return EngineLimits(
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        max_model_len=64,
        block_size=16,
        num_speculative_tokens=drafts,
    )


def needed(drafts: int) -> int:
    """States (drafts + 2 rows) and the KV blocks of one sequence."""
    return (drafts + 2) * ROW_BYTES + limits(drafts).max_blocks_per_seq * BLOCK_BYTES


def test_drafts_that_fit_pass():
    limits(8).check_draft_room(needed(8), BLOCK_BYTES, ROW_BYTES)
    limits(0).check_draft_room(0, BLOCK_BYTES, ROW_BYTES)  # no speculation


def test_too_many_drafts_name_the_largest_count_that_fits():
    with pytest.raises(ValueError) as error:
        limits(50).check_draft_room(needed(8), BLOCK_BYTES, ROW_BYTES)
    message = str(error.value)
    assert (
        "num_speculative_tokens=50 (--num-speculative-tokens) is too large" in message
    )
    largest = int(re.search(r"at most (\d+) draft tokens fit", message)[1])
    assert largest == 8
    limits(largest).check_draft_room(needed(8), BLOCK_BYTES, ROW_BYTES)


def test_a_cache_too_small_for_one_draft_is_left_to_the_kv_check():
    limits(50).check_draft_room(needed(1) - 1, BLOCK_BYTES, ROW_BYTES)
