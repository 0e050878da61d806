"""prepare_inputs: flat rows, positions, paged slots and per-sequence metadata."""

import pytest
import torch

from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs


def seq(seq_id, tokens, context_len, blocks, slot, spec=0):
    return SeqWork(
        seq_id, tokens, context_len, blocks, slot, True, spec, 0.0, 0, 1.0, None
    )


def test_rows_positions_slots_and_metadata():
    seqs = [
        seq(7, [11, 12, 13], 2, [5, 9], slot=1),  # positions 2, 3, 4 (block 9 for 4)
        seq(8, [21, 22, 23], 6, [3, 0, 6], slot=0, spec=2),  # verify rows 6, 7, 8
    ]
    ids, positions, md = prepare_inputs(seqs, block_size=4, device="cpu")
    assert ids.tolist() == [11, 12, 13, 21, 22, 23]
    assert positions.tolist() == [2, 3, 4, 6, 7, 8]
    assert md.slot_mapping.tolist() == [22, 23, 36, 2, 3, 24]
    assert md.slot_mapping.dtype == torch.long
    assert md.query_start_loc == [0, 3, 6]
    assert md.context_lens == [2, 6] and md.state_slots == [1, 0]
    assert md.block_tables == [[5, 9], [3, 0, 6]]
    assert md.verify == [False, True]
    assert md.rows(1) == slice(3, 6)


@pytest.mark.parametrize(
    "bad, message",
    [
        (seq(1, [1, 2], 7, [0, 1], 0), "position 8 needs block 2"),
        (seq(1, [1, 2], 0, [0], 0, spec=2), "num_spec_tokens=2 with 2 rows"),
        (seq(1, [], 0, [0], 0), "no rows"),
    ],
)
def test_bad_work_is_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        prepare_inputs([bad], block_size=4, device="cpu")
