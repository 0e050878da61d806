"""pending_rows: a batch's pending rows, put right on the device, equal the rows
the host would have built knowing the previous batch's tokens and acceptance."""

import dataclasses

import pytest
import torch

from atom.kernels import triton_available
from atom.model_engine.batch import ScheduledBatch, SeqWork
from atom.model_engine.model_inputs import build_step
from atom.model_engine.pending_tokens import SampledTokens, pending_rows
from atom.model_ops.sampling_metadata import SamplingMetadata

BLOCK = 4
CPU = torch.device("cpu")


def decode(seq_id: int, pending: bool = True, rows: int = 1, **fields) -> SeqWork:
    return SeqWork(
        seq_id=seq_id,
        token_ids=[0 if pending else 9] * rows,
        context_len=fields.pop("context_len", 5),
        block_table=[seq_id, 20 + seq_id, 40 + seq_id, 60 + seq_id],
        state_slot=seq_id,
        input_pending=pending,
        num_drafts=rows - 1,
        **fields,
    )


@pytest.fixture(params=[False, True], ids=["torch", "kernel"])
def kernel(request) -> bool:
    """Whether PendingRows fills in one launch (atom/kernels/pending_fill.py, here
    through Triton's interpreter) or with torch operators."""
    if request.param:
        if not triton_available(CPU):
            pytest.skip("triton cannot run here")
        request.applymarker(pytest.mark.kernels)
    return request.param


def filled(batch: ScheduledBatch, previous: SampledTokens, kernel: bool) -> list[int]:
    packed, layout = build_step(batch.work, BLOCK)
    rows = pending_rows(batch, previous, BLOCK, CPU, kernel)
    if rows is not None:
        rows.fill(packed, layout, commit=lambda slots, rows: None)
    return packed[: layout.num_tokens].tolist()


@pytest.fixture
def previous() -> SampledTokens:
    sampled = ScheduledBatch(1, [decode(s, pending=False) for s in (10, 11, 12)])
    return SampledTokens(sampled, torch.tensor([[100], [101], [102]]), torch.zeros(3))


def test_steady_decode_takes_the_tokens_in_order(previous, kernel):
    batch = ScheduledBatch(2, [decode(10), decode(11), decode(12)])
    assert filled(batch, previous, kernel) == [100, 101, 102]


@pytest.mark.parametrize(
    "works, expected",
    [
        # Fewer sequences, one dropped from the middle.
        ([decode(10), decode(12)], [100, 102]),
        # Another order.
        ([decode(12), decode(10), decode(11)], [102, 100, 101]),
        # A sequence that waits for the host first (its input is known).
        ([decode(13, pending=False), decode(10), decode(11)], [9, 100, 101]),
    ],
)
def test_other_batches_take_each_sequences_own_token(previous, works, expected, kernel):
    assert filled(ScheduledBatch(2, works), previous, kernel) == expected


def test_a_batch_without_pending_inputs_has_no_rows(previous):
    batch = ScheduledBatch(2, [decode(13, pending=False)])
    assert pending_rows(batch, previous, BLOCK, CPU) is None


def test_a_pending_input_the_previous_batch_did_not_sample_is_refused(previous):
    batch = ScheduledBatch(2, [decode(13)])
    with pytest.raises(RuntimeError, match="did not sample it"):
        filled(batch, previous, kernel=False)


# ---- after a verify: T = 3 drafts, the context counted every draft accepted ----
T = 3


def verified_previous(seq_ids: list[int], accepted: list[int]) -> SampledTokens:
    """The previous batch: each sequence verified T drafts and kept `accepted`;
    its next inputs are (anchor, T drafts) = 100 * seq + (0, 1, 2, 3)."""
    works = [decode(s, pending=False, rows=1 + T) for s in seq_ids]
    # Views of one fetch row per sequence [accepted, emitted (1 + T), anchor,
    # drafts], as StepSampler.launch leaves them.
    fetch = torch.full((len(seq_ids), 3 + 2 * T), -1)
    fetch[:, 0] = torch.tensor(accepted)
    fetch[:, 2 + T :] = torch.tensor(
        [[100 * s + j for j in range(1 + T)] for s in seq_ids]
    )
    return SampledTokens(ScheduledBatch(1, works), fetch[:, 2 + T :], fetch[:, 0])


def resolved(work: SeqWork, previous: SampledTokens) -> SeqWork:
    """What the host would have scheduled knowing the previous batch."""
    source = previous.batch.sample_seq_ids.index(work.seq_id)
    rows = previous.next_inputs[source, : work.num_rows].tolist()
    rejected = work.unconfirmed_drafts - int(previous.accepted[source])
    return dataclasses.replace(
        work,
        token_ids=rows,
        context_len=work.context_len - rejected,
        input_pending=False,
        unconfirmed_drafts=0,
    )


def sampling_of(works: list[SeqWork]) -> SamplingMetadata:
    return SamplingMetadata.from_works(works, CPU, drafts_next=True)


@pytest.mark.parametrize(
    "order, accepted",
    [
        ([10, 11, 12], [0, 3, 1]),  # steady decode: slices, no index
        ([12, 10], [2, 0, 3]),  # another order, one sequence gone
    ],
)
def test_rows_after_a_verify_take_back_the_rejected_drafts(order, accepted, kernel):
    previous = verified_previous([10, 11, 12], accepted)
    # Contexts of 5 + 1 + T: the previous verify's rows all counted as accepted.
    works = [
        decode(s, rows=1 + T, context_len=6 + T, unconfirmed_drafts=T) for s in order
    ]
    batch = ScheduledBatch(2, works)
    truth = [resolved(work, previous) for work in works]
    expected, expected_layout = build_step(truth, BLOCK)

    packed, layout = build_step(works, BLOCK)
    assert layout == expected_layout
    rows = pending_rows(batch, previous, BLOCK, CPU, kernel)
    commits = []
    rows.fill(packed, layout, commit=lambda *given: commits.append(given))
    assert torch.equal(packed, expected)
    ((slots, snapshot_rows),) = commits
    assert slots.tolist() == order
    sources = [previous.batch.sample_seq_ids.index(s) for s in order]
    assert snapshot_rows.tolist() == [accepted[i] for i in sources]

    sampling = sampling_of(works)
    rows.fix_sampling(sampling)
    want = sampling_of(truth)
    assert torch.equal(sampling.positions, want.positions)
    assert torch.equal(sampling.spec.draft_ids, want.spec.draft_ids)


def test_a_first_verify_after_a_prefill_takes_its_drafts_and_commits_nothing(
    kernel,
):
    """A sequence whose previous batch sampled its prompt's last chunk verified no
    drafts there: its context is exact, only its rows are pending."""
    previous = verified_previous([10, 11], [0, 0])
    works = [
        decode(10, rows=1 + T, context_len=8, unconfirmed_drafts=0),
        decode(11, rows=1 + T, context_len=6 + T, unconfirmed_drafts=T),
    ]
    truth = [resolved(work, previous) for work in works]
    expected, _ = build_step(truth, BLOCK)
    packed, layout = build_step(works, BLOCK)
    commits = []
    rows = pending_rows(ScheduledBatch(2, works), previous, BLOCK, CPU, kernel)
    rows.fill(packed, layout, commit=lambda *given: commits.append(given))
    assert torch.equal(packed, expected)
    ((slots, snapshot_rows),) = commits
    assert slots.tolist() == [11] and snapshot_rows.tolist() == [0]
