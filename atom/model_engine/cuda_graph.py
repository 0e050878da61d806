"""CUDA graphs of one pipeline stage's forward, for a ladder of step shapes.

Two kinds of step have shapes that a few sizes cover, so each stage captures its
forward once per shape at start-up and replays it: one launch instead of hundreds.
- A decode step (one row per sequence, or the k + 1 rows of a speculative verify),
  per (batch size, rows per sequence): a batch is padded with dummy sequences up
  to the next captured size.
- A short prefill of one fresh prompt, per token count: the prompt's rows come
  first and one dummy sequence takes the rows up to the captured count, so every
  shape of the step (rows, sequences, query width) is the capture's. At these
  sizes an eager prefill is host work all through (hundreds of launches for a
  millisecond or two of kernels); the attention and KDA paths it takes are the
  eager ones for that shape (`attention_backend.py`, `kda_backend.py`).
Dummy sequences write to a scratch KV slot and a scratch state slot that no request
owns, start from a zero state, and no real row attends to them.

Every input of a captured forward lives in a static buffer that replay refills: token
ids, positions, the attention metadata tensors and, on a non-first stage, the
previous stage's payload. Block tables have a fixed width, enough for a sequence of
`max_model_len` tokens plus the drafter's rows.

`after_forward`, when given, is captured with the forward and runs on its positions
and slot mapping: the DSpark drafter writes its context rows from the taps there
(padding rows land in the scratch slot), so a step's draft-side writes are part of
the same replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
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


def prefill_capture_sizes(requested: Iterable[int], max_tokens: int) -> list[int]:
    """The prefill token counts to capture: the requested ones
    (`Config.prefill_capture_sizes`) that a step may hold (`max_tokens`). Past 256
    rows a KDA prefill takes fla's chunked kernels (`TritonKDABackend`), and its
    GPU time outweighs the host's anyway."""
    return sorted({s for s in requested if 1 <= s <= max_tokens})


@dataclass(frozen=True)
class DecodeShape:
    """`batch_size` sequences (padding included) of `query_len` rows each, every
    row after a sequence's first a draft under verification."""

    batch_size: int
    query_len: int

    @property
    def num_rows(self) -> int:
        return self.batch_size * self.query_len

    def padding(self, kv_slot: int, state_slot: int) -> SeqPadding:
        return SeqPadding(self.batch_size, kv_slot, state_slot)

    def dummy(self, table_width: int, state_slot: int) -> SeqWork:
        """The continuing sequence a capture of this shape runs."""
        return SeqWork(
            seq_id=0,
            token_ids=[0] * self.query_len,
            context_len=1,
            block_table=[0] * table_width,
            state_slot=state_slot,
            sample=False,
            num_drafts=self.query_len - 1,
        )


@dataclass(frozen=True)
class PrefillShape:
    """One fresh prompt in `num_tokens` rows: all of them (`padded` False), or
    fewer, with one dummy sequence holding the rest."""

    num_tokens: int
    padded: bool

    @property
    def num_rows(self) -> int:
        return self.num_tokens

    def padding(self, kv_slot: int, state_slot: int) -> SeqPadding:
        return SeqPadding(1 + self.padded, kv_slot, state_slot, self.num_tokens)

    def dummy(self, table_width: int, state_slot: int) -> SeqWork:
        """The prompt a capture of this shape runs."""
        return SeqWork(
            seq_id=0,
            token_ids=[0] * (self.num_tokens - self.padded),
            context_len=0,
            block_table=[0] * table_width,
            state_slot=state_slot,
            sample=False,
        )


GraphShape = DecodeShape | PrefillShape


def graph_shape_for(
    works: list[SeqWork], shapes: Iterable[GraphShape], table_width: int
) -> GraphShape | None:
    """The smallest of `shapes` that runs this batch, or None (run it eagerly).
    Every sequence's block table must fit the captured `table_width`."""
    first = works[0]
    if first.context_len == 0:
        # One fresh prompt with nothing to verify: a short prefill.
        if len(works) > 1 or first.num_drafts or len(first.block_table) > table_width:
            return None
        rows = first.num_rows
        fitting = [
            shape
            for shape in shapes
            if isinstance(shape, PrefillShape)
            and shape.num_tokens >= rows
            and shape.padded == (shape.num_tokens > rows)
        ]
        return min(fitting, key=lambda shape: shape.num_tokens, default=None)
    # Decode: every sequence continues with the same rows, and rows beyond the
    # first are all drafts under verification (one pass: this runs every step).
    query_len = first.num_rows
    for work in works:
        if (
            work.num_rows != query_len
            or work.context_len == 0
            or work.num_drafts != query_len - 1
            or len(work.block_table) > table_width
        ):
            return None
    fitting = [
        shape
        for shape in shapes
        if isinstance(shape, DecodeShape)
        and shape.query_len == query_len
        and shape.batch_size >= len(works)
    ]
    return min(fitting, key=lambda shape: shape.batch_size, default=None)


@dataclass
class _Capture:
    graph: torch.cuda.CUDAGraph
    # The static buffer every input of the capture is a view of, and its layout.
    packed: torch.Tensor
    layout: StepLayout
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    output: torch.Tensor | IntermediateTensors


class StepGraphs:
    """Captured forwards of `model`, one per shape of `shapes`."""

    def __init__(
        self,
        model: nn.Module,
        shapes: list[GraphShape],
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
        self.block_size = block_size
        self.table_width = table_width
        self.kv_slot, self.state_slot = padding_slots
        self.device = device
        max_rows = max(shape.num_rows for shape in shapes)
        self.payload = None
        if not is_first_stage:
            self.payload = model.make_empty_intermediate_tensors(
                max_rows, dtype, device
            )
        self.captures: dict[GraphShape, _Capture] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller captures then fit in the pool's blocks.
        for shape in sorted(shapes, key=lambda shape: shape.num_rows, reverse=True):
            capture = self._capture(shape, pool)
            if capture is not None:
                self.captures[shape] = capture
        logger.info(
            "captured %d of %d graphs in %.1f s (first runs of a shape compile its "
            "kernels): decode %s, prefill tokens %s",
            len(self.captures),
            len(shapes),
            time.perf_counter() - start,
            sorted(
                (s.batch_size, s.query_len)
                for s in shapes
                if isinstance(s, DecodeShape)
            ),
            sorted({s.num_tokens for s in shapes if isinstance(s, PrefillShape)}),
        )

    def _payload(self, rows: int) -> IntermediateTensors | None:
        if self.payload is None:
            return None
        return IntermediateTensors(
            {key: value[:rows] for key, value in self.payload.items()}
        )

    def _capture(self, shape: GraphShape, pool) -> _Capture | None:
        # The shape's dummy sequence on the scratch slots, padded as every replay
        # of this shape is: the capture's layout is the one they build.
        padding = shape.padding(self.kv_slot, self.state_slot)
        dummy = shape.dummy(self.table_width, self.state_slot)
        packed, layout = build_step([dummy], self.block_size, self.table_width, padding)
        packed = packed.to(self.device)
        ids, positions, metadata = view_step(packed, layout)
        metadata.slot_mapping.fill_(self.kv_slot)
        payload = self._payload(shape.num_rows)

        def forward() -> torch.Tensor | IntermediateTensors:
            output = self.model(ids, positions, payload)
            if self.after_forward is not None:
                self.after_forward(positions, metadata.slot_mapping)
            return output

        with set_forward_context(ForwardContext(metadata)):
            captured = capture_graph(forward, pool, self.device, f"the {shape}")
        if captured is None:
            return None
        graph, output = captured
        return _Capture(graph, packed, layout, metadata.slot_mapping, positions, output)

    def shape_for(self, works: list[SeqWork]) -> GraphShape | None:
        """The capture that runs this batch, or None (run it eagerly); a shape
        whose capture failed at start-up is simply absent."""
        return graph_shape_for(works, self.captures, self.table_width)

    def run(
        self,
        shape: GraphShape,
        works: list[SeqWork],
        intermediate: IntermediateTensors | None,
        fill: InputFiller | None = None,
    ) -> tuple[torch.Tensor | IntermediateTensors, torch.Tensor, torch.Tensor]:
        """Replay the capture of `shape` for `works`: (output rows, positions and
        slot mapping of the real sequences' rows, which come first). `fill` writes
        the pending rows (pending_tokens.py) into the static buffer first."""
        capture = self.captures[shape]
        packed, layout = build_step(
            works,
            self.block_size,
            self.table_width,
            shape.padding(self.kv_slot, self.state_slot),
        )
        if layout != capture.layout:
            raise RuntimeError(
                f"batch layout {layout} differs from the captured {capture.layout}"
            )
        # Pinned, so the copy does not hold the host (model_inputs.to_device).
        capture.packed.copy_(pinned(packed), non_blocking=True)
        if fill is not None:
            fill(capture.packed, capture.layout)
        num_rows = sum(work.num_rows for work in works)
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
