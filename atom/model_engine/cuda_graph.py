"""CUDA graphs of one pipeline stage's decode forward, for a ladder of batch sizes.

A decode step (one row per sequence, or the k + 1 rows of a speculative verify) has
shapes that depend only on the batch size, so each stage captures its own forward
once per (batch size, rows per sequence) at start-up and replays it: one launch
instead of hundreds. A batch is padded with dummy sequences up to the next captured
size; they write to a scratch KV slot and a scratch state slot that no request owns.

Every input of a captured forward lives in a static buffer that replay refills: token
ids, positions, the attention metadata tensors and, on a non-first stage, the
previous stage's payload. Block tables have a fixed width, enough for a sequence of
`max_model_len` tokens plus the drafter's rows; attention reads that whole width, so
a tight `--max-model-len` makes decode cheaper.

`after_forward`, when given, is captured with the forward and runs on its positions
and slot mapping: the DSpark drafter writes its context rows from the taps there
(padding rows land in the scratch slot), so a verify step's draft-side writes are
part of the same replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from atom.model_engine.batch import SeqWork
from atom.model_engine.model_inputs import (
    SeqPadding,
    StepLayout,
    build_step,
    view_step,
)
from atom.model_engine.pending_tokens import InputFiller
from atom.model_ops.host_copy import pinned
from atom.models.utils import IntermediateTensors
from atom.utils.forward_context import ForwardContext, set_forward_context
from atom.utils.graph_capture import capture_graph

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def capture_sizes(requested: list[int] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: the requested ladder (or the default) up to
    max_num_seqs, always including max_num_seqs itself."""
    sizes = sorted({s for s in (requested or DEFAULT_CAPTURE_SIZES) if s >= 1})
    kept = [s for s in sizes if s < max_num_seqs]
    return [*kept, max_num_seqs]


@dataclass
class _Capture:
    graph: torch.cuda.CUDAGraph
    # The static buffer every input of the capture is a view of, and its layout.
    packed: torch.Tensor
    layout: StepLayout
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    output: torch.Tensor | IntermediateTensors


class DecodeGraphs:
    """Captured decode forwards of `model` for `sizes` x `query_lens`."""

    def __init__(
        self,
        model: nn.Module,
        sizes: list[int],
        query_lens: list[int],
        block_size: int,
        table_width: int,
        padding_slots: tuple[int, int],
        is_first_stage: bool,
        device: torch.device,
        dtype: torch.dtype,
        after_forward: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        self.model = model
        self.after_forward = after_forward
        self.sizes = sorted(sizes)
        self.query_lens = sorted(set(query_lens))
        self.block_size = block_size
        self.table_width = table_width
        self.kv_slot, self.state_slot = padding_slots
        self.device = device
        max_rows = self.sizes[-1] * self.query_lens[-1]
        self.payload = None
        if not is_first_stage:
            self.payload = model.make_empty_intermediate_tensors(
                max_rows, dtype, device
            )
        self.captures: dict[tuple[int, int], _Capture] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for query_len in reversed(self.query_lens):
            for size in reversed(self.sizes):
                capture = self._capture(size, query_len, pool)
                if capture is not None:
                    self.captures[(size, query_len)] = capture
        logger.info(
            "captured %d of %d decode graphs in %.1f s (first runs of a shape "
            "compile its kernels): batch sizes %s x rows per sequence %s",
            len(self.captures),
            len(self.sizes) * len(self.query_lens),
            time.perf_counter() - start,
            self.sizes,
            self.query_lens,
        )

    def _padding(self, size: int) -> SeqPadding:
        return SeqPadding(size, self.kv_slot, self.state_slot)

    def _payload(self, rows: int) -> IntermediateTensors | None:
        if self.payload is None:
            return None
        return IntermediateTensors(
            {key: value[:rows] for key, value in self.payload.items()}
        )

    def _capture(self, size: int, query_len: int, pool) -> _Capture | None:
        # One continuing sequence on the scratch slots, padded to `size`: the
        # capture's layout is the one every replay of this key builds.
        dummy = SeqWork(
            seq_id=0,
            token_ids=[0] * query_len,
            context_len=1,
            block_table=[0] * self.table_width,
            state_slot=self.state_slot,
            sample=False,
            num_drafts=query_len - 1,
        )
        packed, layout = build_step(
            [dummy], self.block_size, self.table_width, self._padding(size)
        )
        packed = packed.to(self.device)
        ids, positions, metadata = view_step(packed, layout)
        metadata.slot_mapping.fill_(self.kv_slot)
        payload = self._payload(size * query_len)

        def forward() -> torch.Tensor | IntermediateTensors:
            output = self.model(ids, positions, payload)
            if self.after_forward is not None:
                self.after_forward(positions, metadata.slot_mapping)
            return output

        with set_forward_context(ForwardContext(metadata)):
            captured = capture_graph(
                forward,
                pool,
                self.device,
                f"the decode forward at batch size {size} x {query_len} rows",
            )
        if captured is None:
            return None
        graph, output = captured
        return _Capture(graph, packed, layout, metadata.slot_mapping, positions, output)

    def size_for(self, works: list[SeqWork]) -> tuple[int, int] | None:
        """The capture that runs this batch, or None (run it eagerly).

        Decode batches only: every sequence continues (context > 0) with the same
        rows, and rows beyond the first are all drafts under verification.
        """
        query_len = works[0].num_rows
        for work in works:
            if work.num_rows != query_len or work.context_len == 0:
                return None
            if work.num_drafts != query_len - 1:
                return None
            if len(work.block_table) > self.table_width:
                return None
        # The smallest capture that holds the batch; a size whose capture failed
        # at start-up is simply absent.
        fitting = [
            key for key in self.captures if key[1] == query_len and key[0] >= len(works)
        ]
        return min(fitting, default=None)

    def run(
        self,
        key: tuple[int, int],
        works: list[SeqWork],
        intermediate: IntermediateTensors | None,
        fill: InputFiller | None = None,
    ) -> tuple[torch.Tensor | IntermediateTensors, torch.Tensor, torch.Tensor]:
        """Replay the capture `key` for `works`: (output rows, positions and slot
        mapping of the real sequences' rows, which come first). `fill` writes the
        pending rows (pending_tokens.py) into the static buffer first."""
        size, query_len = key
        capture = self.captures[key]
        packed, layout = build_step(
            works, self.block_size, self.table_width, self._padding(size)
        )
        if layout != capture.layout:
            raise RuntimeError(
                f"batch layout {layout} differs from the captured {capture.layout}"
            )
        # Pinned, so the copy does not hold the host (model_inputs.to_device).
        capture.packed.copy_(pinned(packed), non_blocking=True)
        if fill is not None:
            fill(capture.packed, capture.layout)
        num_rows = len(works) * query_len
        if intermediate is not None:
            static = self._payload(num_rows)
            for name, value in intermediate.items():
                if value.data_ptr() != static[name].data_ptr():  # not received in
                    static[name].copy_(value)
        capture.graph.replay()
        output = capture.output
        if isinstance(output, IntermediateTensors):
            output = IntermediateTensors(
                {name: value[:num_rows] for name, value in output.items()}
            )
        else:
            output = output[:num_rows]
        return output, capture.positions[:num_rows], capture.slot_mapping[:num_rows]
