"""The last batch's sampled tokens, kept on the device for the batch after it.

Async scheduling (`run_ahead.py`) schedules a decoding sequence again before its
sampled token reaches the host. Its row's input is a placeholder, which the filler
overwrites on the device from the previous batch's tokens after the step's inputs
are copied there and before the forward (or the graph replay) reads them. The
device stream orders that read after the sampling that wrote the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atom.model_engine.batch import ScheduledBatch
from atom.model_ops.host_copy import host_to_device

InputFiller = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class SampledTokens:
    """The tokens one batch sampled, on the device: the step sampler's emitted
    tokens [S, W], one row per sampled sequence in batch order, whose first column
    is that sequence's next input (async scheduling runs without drafts). Kept as
    given: only a batch with pending inputs looks its rows up."""

    batch: ScheduledBatch
    emitted: torch.Tensor


def pending_input_filler(
    batch: ScheduledBatch, previous: SampledTokens | None, device: torch.device
) -> InputFiller | None:
    """What writes the pending inputs of `batch` into its input ids on the device;
    None when it has none."""
    targets, sources = [], []
    rows: dict[int, int] | None = None
    row = 0
    for work in batch.work:
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
            targets.append(row)
            sources.append(source)
        row += work.num_rows
    if not targets:
        return None
    tokens = previous.emitted[:, 0]
    count = len(targets)
    if targets == sources and targets[-1] == count - 1:
        # Steady decode: rows 0..n-1 take the previous batch's tokens 0..n-1 (the
        # rows only grow, so the last one names them all): one device copy, no
        # index to send.
        def fill_in_order(input_ids: torch.Tensor) -> None:
            input_ids[:count].copy_(tokens[:count])

        return fill_in_order
    index = host_to_device(targets + sources, torch.long, device).view(2, -1)

    def fill(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

    return fill
