"""The small per-forward context that attention and state layers read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's rows sit in the flat batch and in the caches."""

    query_start_loc: list[int]  # B + 1 cumulative row offsets
    context_lens: list[int]  # tokens already cached before this forward, per sequence
    slot_mapping: torch.Tensor  # [N] paged-KV slot of every row
    block_tables: list[list[int]]
    state_slots: list[int]  # KDA state slot per sequence
    # Per sequence: rows are [last, d1..dT] under verification, so KDA layers keep
    # the state after every row as snapshots for commit(num_accepted).
    verify: list[bool] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def rows(self, i: int) -> slice:
        return slice(self.query_start_loc[i], self.query_start_loc[i + 1])


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None = None
    is_draft: bool = False
    # Row offset of this micro-batch inside the step's tap buffers.
    token_offset: int = 0
    extras: dict = field(default_factory=dict)


_CONTEXT = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _CONTEXT


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    saved, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = saved
