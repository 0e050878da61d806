"""pending_input_filler: pending inputs take the previous batch's sampled tokens."""

import pytest
import torch

from atom.model_engine.batch import ScheduledBatch, SeqWork
from atom.model_engine.pending_tokens import SampledTokens, pending_input_filler


def decode(seq_id: int, pending: bool = True, rows: int = 1) -> SeqWork:
    return SeqWork(
        seq_id=seq_id,
        token_ids=[0 if pending else 9] * rows,
        context_len=5,
        block_table=[0],
        state_slot=seq_id,
        input_pending=pending,
    )


def filled(batch: ScheduledBatch, previous: SampledTokens) -> list[int]:
    fill = pending_input_filler(batch, previous, torch.device("cpu"))
    input_ids = torch.tensor([t for work in batch.work for t in work.token_ids])
    if fill is not None:
        fill(input_ids)
    return input_ids.tolist()


@pytest.fixture
def previous() -> SampledTokens:
    sampled = ScheduledBatch(1, [decode(s, pending=False) for s in (10, 11, 12)])
    return SampledTokens(sampled, torch.tensor([[100], [101], [102]]))


def test_steady_decode_takes_the_tokens_in_order(previous):
    batch = ScheduledBatch(2, [decode(10), decode(11), decode(12)])
    assert filled(batch, previous) == [100, 101, 102]


@pytest.mark.parametrize(
    "works, expected",
    [
        # Fewer sequences, one dropped from the middle.
        ([decode(10), decode(12)], [100, 102]),
        # Another order.
        ([decode(12), decode(10), decode(11)], [102, 100, 101]),
        # A sequence that waits for the host first (its input is known).
        ([decode(13, pending=False), decode(10), decode(11)], [9, 100, 101]),
        # A prefill chunk of two rows after the pending ones.
        ([decode(10), decode(11), decode(14, pending=False, rows=2)], [100, 101, 9, 9]),
    ],
)
def test_other_batches_take_each_sequences_own_token(previous, works, expected):
    assert filled(ScheduledBatch(2, works), previous) == expected


def test_a_batch_without_pending_inputs_has_no_filler(previous):
    batch = ScheduledBatch(2, [decode(13, pending=False)])
    assert pending_input_filler(batch, previous, torch.device("cpu")) is None


def test_a_pending_input_the_previous_batch_did_not_sample_is_refused(previous):
    batch = ScheduledBatch(2, [decode(13)])
    with pytest.raises(RuntimeError, match="did not sample it"):
        filled(batch, previous)
