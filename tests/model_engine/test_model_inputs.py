"""prepare_inputs: flat rows, positions, paged slots and per-sequence metadata."""

import pytest
import torch

from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import prepare_inputs


def seq(seq_id, tokens, context_len, blocks, slot, spec=0):
    return SeqWork(
        seq_id=seq_id,
        token_ids=tokens,
        context_len=context_len,
        block_table=blocks,
        state_slot=slot,
        num_drafts=spec,
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
    assert md.query_start_loc.tolist() == [0, 3, 6]
    assert md.context_lens.tolist() == [2, 6] and md.state_slots.tolist() == [1, 0]
    # Tables are padded with block 0 (read under a mask, never written).
    assert md.block_tables.tolist() == [[5, 9, 0], [3, 0, 6]]
    assert md.keeps_row_states and not md.all_fresh and md.query_len == 3
    assert md.query_positions.tolist() == [[2, 3, 4], [6, 7, 8]]


def test_ragged_rows_pad_and_unpad():
    seqs = [
        seq(1, [5, 6, 7], 0, [0], slot=0),
        seq(2, [8], 4, [1, 2], slot=1),
        seq(3, [9, 1], 0, [3], slot=2),
    ]
    ids, _, md = prepare_inputs(seqs, block_size=4, device="cpu")
    assert md.query_len == 0 and md.max_query_len == 3 and not md.all_fresh
    assert md.context_lens.tolist() == [0, 4, 0]
    padded = md.pad(ids)
    assert padded.tolist() == [[5, 6, 7], [8, 0, 0], [9, 1, 0]]
    assert torch.equal(md.unpad(padded), ids)
    rows = torch.arange(12.0).view(6, 2)
    assert torch.equal(md.unpad(md.pad(rows)), rows)


@pytest.mark.parametrize(
    "bad, message",
    [
        (seq(1, [1, 2], 7, [0, 1], 0), "position 8 needs block 2"),
        (seq(1, [1, 2], 0, [0], 0, spec=2), "num_drafts=2 with 2 rows"),
        (seq(1, [], 0, [0], 0), "no rows"),
    ],
)
def test_bad_work_is_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        prepare_inputs([bad], block_size=4, device="cpu")


@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_bad_work_anywhere_in_the_batch_is_named(at):
    batch = [seq(i, [1], 3, [i], i) for i in range(3)]
    batch[at] = seq(at, [1, 2], 7, [0, 1], at)
    with pytest.raises(ValueError, match="position 8 needs block 2"):
        prepare_inputs(batch, block_size=4, device="cpu")
