"""The last batch's sampled tokens, kept on the device for the batch after it.

Async scheduling (`run_ahead.py`) schedules a decoding sequence again before its
sampled tokens reach the host. Its rows' inputs are placeholders and, after a
verify, its context counts every unconfirmed draft as accepted. `PendingRows` puts
both right on the device from the previous batch's tokens and acceptance: on the
step buffer after it is copied there and before the forward (or the graph replay)
reads it, and on the step's SamplingMetadata before the sampler reads it. The device
stream orders all of it after the sampling that wrote those tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.model_engine.batch import ScheduledBatch
from atom.model_engine.model_inputs import StepLayout, input_ids_of, view_step
from atom.model_ops.host_copy import hosts_to_device
from atom.model_ops.sampling_metadata import SamplingMetadata

# Writes a step's pending rows into its packed buffer on the device.
InputFiller = Callable[[torch.Tensor, StepLayout], None]
# Commits recurrent states on the device: (state slots [C], snapshot rows [C]).
CommitRows = Callable[[torch.Tensor, torch.Tensor], None]
# A slice for pending works that lead the batch in the previous batch's order, else
# a device index tensor.
Selection = slice | torch.Tensor


@dataclass(frozen=True)
class SampledTokens:
    """What one batch sampled, on the device, one row per sampled sequence in batch
    order. Kept as given: only a batch with pending rows looks them up."""

    batch: ScheduledBatch
    # [S, 1 + T] long: each sequence's next input rows, its last emitted token and
    # the T drafts proposed after it (T = 0 without a drafter).
    next_inputs: torch.Tensor
    # [S] long: the drafts each sequence kept (zeros without drafts).
    accepted: torch.Tensor


@dataclass(frozen=True)
class _Selections:
    """Where the pending works sit: their batch rows (= sampled rows: a decode
    batch samples every work), their token rows and the first of them, the
    previous batch's rows they take from; and the works whose state is committed,
    with their sources."""

    works: Selection
    tokens: Selection
    firsts: Selection
    sources: Selection
    committed: Selection
    committed_sources: Selection


class PendingRows:
    """A batch's pending rows and how to put them right on the device."""

    def __init__(
        self,
        previous: SampledTokens,
        selections: _Selections,
        num_works: int,
        num_rows: int,
        unconfirmed: int | torch.Tensor | None,
        block_size: int,
        kernel: bool = False,
    ) -> None:
        self.previous = previous
        self.at = selections
        self.num_works = num_works
        # Rows of every pending work: 1 + T with a drafter, else 1.
        self.num_rows = num_rows
        self.block_size = block_size
        # The drafts each pending work's context counted as accepted (one count
        # for all, or [P]); None when no work verified drafts there.
        self.unconfirmed = unconfirmed
        # One launch for the step buffer's writes after a verify
        # (atom/kernels/pending_fill.py).
        self.kernel = kernel
        # [P] of those drafts the previous batch rejected, once `fill` has run.
        self.rejected: torch.Tensor | None = None

    def fill(
        self, packed: torch.Tensor, layout: StepLayout, commit: CommitRows
    ) -> None:
        """Write the pending inputs into the step buffer `packed`, commit each
        verified sequence's state to its last accepted row (`commit`: slots, rows)
        and take the rejected rows back from positions, slots and context lengths."""
        if self.unconfirmed is None:
            # Inputs only (one copy), as after a plain decode step.
            self._fill_with_torch(packed, layout)
            return
        if self.kernel:
            self._fill_in_one_launch(packed, layout)
        else:
            self._fill_with_torch(packed, layout)
        at, slots_at = self.at, layout.offset("state_slots")
        state_slots = packed[slots_at : slots_at + layout.num_seqs]
        commit(state_slots[at.committed], self.previous.accepted[at.committed_sources])

    def _fill_with_torch(self, packed: torch.Tensor, layout: StepLayout) -> None:
        at, rows, previous = self.at, self.num_rows, self.previous
        inputs = previous.next_inputs[at.sources, :rows]
        input_ids_of(packed, layout)[at.tokens] = inputs.reshape(-1)
        if self.unconfirmed is None:
            return
        self.rejected = rejected = self.unconfirmed - previous.accepted[at.sources]
        _, positions, metadata = view_step(packed, layout)
        moved = positions[at.tokens].view(self.num_works, rows) - rejected[:, None]
        positions[at.tokens] = moved.reshape(-1)
        metadata.context_lens[at.works] -= rejected
        metadata.query_positions[at.works] -= rejected[:, None]
        blocks = metadata.block_tables[at.works].gather(1, moved // self.block_size)
        slots = blocks * self.block_size + moved % self.block_size
        metadata.slot_mapping[at.tokens] = slots.reshape(-1)

    def _fill_in_one_launch(self, packed: torch.Tensor, layout: StepLayout) -> None:
        from atom.kernels.pending_fill import pending_fill

        at = self.at
        in_order = isinstance(at.works, slice)
        self.rejected = pending_fill(
            packed,
            layout,
            self.block_size,
            self.previous.next_inputs,
            self.previous.accepted,
            self.num_rows,
            self.num_works if in_order else (at.works, at.firsts, at.sources),
            self.unconfirmed,
        )

    def fix_sampling(self, sampling: SamplingMetadata) -> None:
        """The pending works' drafts to verify, and their decided positions with
        the rejected drafts taken back (after `fill`)."""
        at = self.at
        if self.unconfirmed is not None:
            if self.rejected is None:
                raise RuntimeError(
                    "fix_sampling needs the rejected counts: run fill first"
                )
            sampling.positions[at.works] -= self.rejected
        if self.num_rows > 1:
            drafts = self.previous.next_inputs[at.sources, 1 : self.num_rows]
            sampling.spec.draft_ids[at.works, : self.num_rows - 1] = drafts


def pending_rows(
    batch: ScheduledBatch,
    previous: SampledTokens | None,
    block_size: int,
    device: torch.device,
    kernel: bool = False,
) -> PendingRows | None:
    """The pending rows of `batch`; None when it has none (`kernel`: fill them in
    one launch, `PendingRows.kernel`)."""
    works, firsts, sources, unconfirmed = [], [], [], []
    rows: dict[int, int] | None = None
    row = 0
    num_rows = None
    for index, work in enumerate(batch.work):
        if work.input_pending:
            if previous is None or previous.batch.batch_id != batch.batch_id - 1:
                raise RuntimeError(
                    f"batch {batch.batch_id} takes sequence {work.seq_id}'s input "
                    "from the batch before it, which sampled no tokens"
                )
            if rows is None:
                seq_ids = previous.batch.sample_seq_ids
                rows = {seq_id: i for i, seq_id in enumerate(seq_ids)}
            source = rows.get(work.seq_id)
            if source is None:
                raise RuntimeError(
                    f"batch {batch.batch_id} takes sequence {work.seq_id}'s input "
                    f"from batch {previous.batch.batch_id}, which did not sample it"
                )
            if num_rows not in (None, work.num_rows):
                raise RuntimeError(
                    f"batch {batch.batch_id}: pending works of {num_rows} and "
                    f"{work.num_rows} rows (each takes 1 + T rows)"
                )
            num_rows = work.num_rows
            works.append(index)
            firsts.append(row)
            sources.append(source)
            unconfirmed.append(work.unconfirmed_drafts)
        row += work.num_rows
    if not works:
        return None
    count = len(works)
    verified = [i for i, n in enumerate(unconfirmed) if n]
    in_order = works == sources == list(range(count))
    if in_order and len(set(unconfirmed)) == 1:
        # Steady decode: the works lead both batches in one order, so slices name
        # them and nothing but the rejected counts is computed on the device.
        every = slice(0, count)
        tokens = slice(0, count * num_rows)
        firsts = slice(0, count * num_rows, num_rows)
        at = _Selections(every, tokens, firsts, every, every, every)
        taken_back = unconfirmed[0] or None
    else:
        token_rows = [first + i for first in firsts for i in range(num_rows)]
        fields = [
            (works, torch.long, (count,)),
            (token_rows, torch.long, (len(token_rows),)),
            (firsts, torch.long, (count,)),
            (sources, torch.long, (count,)),
            ([works[i] for i in verified], torch.long, (len(verified),)),
            ([sources[i] for i in verified], torch.long, (len(verified),)),
            (unconfirmed, torch.long, (count,)),
        ]
        *selected, counts = hosts_to_device(fields, device)
        at = _Selections(*selected)
        taken_back = counts if verified else None
    return PendingRows(previous, at, count, num_rows, taken_back, block_size, kernel)
