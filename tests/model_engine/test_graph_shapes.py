"""Which captured graph runs a batch (`cuda_graph.graph_shape_for`) and how a short
prefill is padded to its shape (`model_inputs.SeqPadding`): host logic, no device."""

import pytest

from atom.model_engine.batch import SeqWork
from atom.model_engine.cuda_graph import (
    DecodeShape,
    PrefillShape,
    graph_shape_for,
    prefill_capture_sizes,
)
from atom.model_engine.model_inputs import SeqPadding

WIDTH = 8
SHAPES = [
    *(DecodeShape(size, rows) for size in (1, 2, 4) for rows in (1, 4)),
    *(PrefillShape(tokens, padded) for tokens in (16, 32) for padded in (False, True)),
]


def fresh(rows: int, table: int = WIDTH) -> SeqWork:
    return SeqWork(
        seq_id=0, token_ids=[1] * rows, context_len=0, block_table=[0] * table,
        state_slot=0,
    )  # fmt: skip


def decode(rows: int, context_len: int = 20) -> SeqWork:
    return SeqWork(
        seq_id=1, token_ids=[1] * rows, context_len=context_len,
        block_table=[0] * WIDTH, state_slot=1, num_drafts=rows - 1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "works, shape",
    [
        ([decode(1)] * 3, DecodeShape(4, 1)),
        ([decode(4)], DecodeShape(1, 4)),
        ([decode(4)] * 5, None),  # more sequences than the largest size
        ([fresh(16)], PrefillShape(16, padded=False)),
        ([fresh(11)], PrefillShape(16, padded=True)),
        ([fresh(17)], PrefillShape(32, padded=True)),
        ([fresh(32)], PrefillShape(32, padded=False)),
        ([fresh(33)], None),  # longer than every prefill size
        ([fresh(4), fresh(4)], None),  # prefills of one prompt only
        ([fresh(4), decode(1)], None),  # prefill and decode mixed
        ([decode(1), fresh(1)], None),
        ([decode(1), decode(4)], None),  # rows per sequence differ
        ([fresh(8, table=WIDTH + 1)], None),  # wider than the captured tables
    ],
)
def test_the_smallest_fitting_capture_runs_a_batch(works, shape):
    assert graph_shape_for(works, SHAPES, WIDTH) == shape


def test_a_continuing_chunk_is_not_a_short_prefill():
    chunk = SeqWork(
        seq_id=0, token_ids=[1] * 8, context_len=16, block_table=[0] * WIDTH,
        state_slot=0,
    )  # fmt: skip
    assert graph_shape_for([chunk], SHAPES, WIDTH) is None


def test_prefill_capture_sizes_fit_a_step():
    assert prefill_capture_sizes((16, 32, 64, 128), 100) == [16, 32, 64]
    assert prefill_capture_sizes([64, 8, 64, 512], 256) == [8, 64]
    assert prefill_capture_sizes((), 4096) == []


@pytest.mark.parametrize(
    "lengths, dummies",
    [([11], [5]), ([16], []), ([3, 4], [8, 1])],
)
def test_dummies_hold_the_rows_left(lengths, dummies):
    padding = SeqPadding(len(lengths) + len(dummies), 0, 0, num_tokens=16)
    assert padding.dummy_lengths(lengths) == dummies


@pytest.mark.parametrize("lengths", [[17], [15], [16, 1]])
def test_rows_that_do_not_fit_the_padding_are_refused(lengths):
    # [15]: no dummy sequence is left for the one row; [17], [16, 1]: too long.
    with pytest.raises(ValueError, match="cannot follow"):
        SeqPadding(1, 0, 0, num_tokens=16).dummy_lengths(lengths)
