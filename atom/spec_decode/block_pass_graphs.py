"""CUDA graphs of DSpark's block pass (backbone to base logits), per batch size.

Each graph also runs the Markov head's greedy decode of those logits, so an
all-greedy batch takes its drafts from the replay without further launches; a
batch with sampled requests decodes the replayed logits eagerly.

The pass writes no cache, so padding is free: dummy sequences sit at position 0
with no visible context rows. Each size's inputs live in one static int64 buffer
that replay refills: anchors [B], anchor positions [B], block tables [B, W]. The
capture itself goes through `atom/utils/graph_capture.py`, like the target's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from atom.kernels import triton_available
from atom.spec_decode.markov_head import greedy_drafts
from atom.utils.graph_capture import capture_graph

logger = logging.getLogger(__name__)


@dataclass
class _BlockCapture:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor
    logits: torch.Tensor
    greedy: torch.Tensor


@dataclass
class BlockPassReplay:
    """One replay's static outputs, for the real sequences; valid until the next
    replay."""

    logits: torch.Tensor  # [B, T, V] base logits
    greedy: torch.Tensor  # [B, T] the Markov head's greedy drafts


def block_pass_and_greedy_drafts(
    draft: nn.Module,
    anchors: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a block-pass graph captures: base logits and their greedy drafts (on a
    GPU the Markov chain in two launches a draft, `kernels/markov_drafts.py`)."""
    logits = draft.block_forward(anchors, positions, tables, num_rows)
    if logits.is_cuda and triton_available(logits.device):
        from atom.kernels.markov_drafts import markov_greedy_drafts

        head = draft.markov_head
        return logits, markov_greedy_drafts(
            logits, anchors, head.markov_w1.weight, head.markov_w2.weight
        )
    return logits, greedy_drafts(logits, anchors, draft.markov_bias)


class BlockPassGraphs:
    """Captured `draft.block_forward` for `sizes` sequences of `num_rows` drafts."""

    def __init__(
        self,
        draft: nn.Module,
        sizes: list[int],
        num_rows: int,
        table_width: int,
        device: torch.device,
    ) -> None:
        self.table_width = table_width
        self.captures: dict[int, _BlockCapture] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):
            packed = torch.zeros(
                size * (2 + table_width), dtype=torch.long, device=device
            )
            args = self._views(packed, size)
            captured = capture_graph(
                lambda args=args: block_pass_and_greedy_drafts(draft, *args, num_rows),
                pool,
                device,
                f"the DSpark block pass at batch size {size}",
            )
            if captured is not None:
                graph, (logits, greedy) = captured
                self.captures[size] = _BlockCapture(graph, packed, logits, greedy)
        logger.info(
            "captured %d of %d DSpark block-pass graphs in %.1f s: %s",
            len(self.captures),
            len(sizes),
            time.perf_counter() - start,
            sorted(self.captures),
        )

    def _views(
        self, packed: torch.Tensor, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        anchors, positions, tables = packed.split([size, size, size * self.table_width])
        return anchors, positions, tables.view(size, self.table_width)

    def run(
        self, anchors: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor
    ) -> BlockPassReplay | None:
        """The real sequences' outputs, or None when no capture covers the batch
        (run it eagerly). Inputs are device tensors."""
        count, width = tables.shape
        if width > self.table_width:
            return None
        size = min((s for s in self.captures if s >= count), default=None)
        if size is None:
            return None
        capture = self.captures[size]
        static_anchors, static_positions, static_tables = self._views(
            capture.packed, size
        )
        static_anchors[:count].copy_(anchors)
        static_positions[:count].copy_(positions)
        static_positions[count:].zero_()  # padding rows see no context
        static_tables.zero_()
        static_tables[:count, :width].copy_(tables)
        capture.graph.replay()
        return BlockPassReplay(capture.logits[:count], capture.greedy[:count])
