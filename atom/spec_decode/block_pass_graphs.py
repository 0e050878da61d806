"""CUDA graphs of DSpark's block pass (backbone to base logits), per batch size.

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

from atom.utils.graph_capture import capture_graph

logger = logging.getLogger(__name__)


@dataclass
class _BlockCapture:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor
    logits: torch.Tensor


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
                lambda args=args: draft.block_forward(*args, num_rows),
                pool,
                device,
                f"the DSpark block pass at batch size {size}",
            )
            if captured is not None:
                self.captures[size] = _BlockCapture(captured[0], packed, captured[1])
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
    ) -> torch.Tensor | None:
        """Base logits [B, T, V] of the real sequences, or None when no capture
        covers the batch (run it eagerly). Inputs are device tensors."""
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
        return capture.logits[:count]
