"""The small per-forward context that attention and state layers read.

`AttentionMetadata` is built once per step (`model_engine/model_inputs.py`) and holds
every per-sequence fact as a device tensor, so layers run one batched computation for
all sequences with no host synchronisation. Host-side integers (`num_seqs`,
`query_len`, ...) decide shapes only; they never come from the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's rows sit in the flat batch, the caches and the states.

    Rows of sequence b are the flat rows `query_start_loc[b]:query_start_loc[b+1]`.
    Layers that need a per-sequence layout use `pad` / `unpad`: the padded layout is
    [num_seqs, max_query_len, ...] with sequence b's rows first and zero rows after.
    """

    num_seqs: int
    num_tokens: int
    max_query_len: int
    # Rows per sequence when every sequence has the same number (decode, verify,
    # training batches): pad/unpad are then free reshapes. 0 otherwise.
    query_len: int
    # Every sequence starts at position 0: no cached row is read, so attention can use
    # this forward's own keys (and gradients reach them).
    all_fresh: bool
    # Decode rows are [last, d1..dT]: recurrent layers keep the state after each row
    # so a later commit(num_accepted) can roll back.
    keeps_row_states: bool
    query_start_loc: torch.Tensor  # [B + 1] long
    context_lens: torch.Tensor  # [B] tokens already cached before this forward
    slot_mapping: torch.Tensor  # [N] paged-KV slot of every row
    block_tables: torch.Tensor  # [B, W] long; unused entries name a scratch block
    state_slots: torch.Tensor  # [B] recurrent-state slot per sequence
    query_positions: torch.Tensor  # [B, max_query_len] position of each padded row
    # Non-uniform batches only: flat row of each padded row (num_tokens = a zero row),
    # and padded index (b * max_query_len + r) of each flat row.
    pad_index: torch.Tensor | None = None
    unpad_index: torch.Tensor | None = None

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] flat rows -> [B, max_query_len, ...] (zeros after each sequence)."""
        if self.query_len:
            return rows.view(self.num_seqs, self.query_len, *rows.shape[1:])
        padded = torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])], dim=0)
        return padded[self.pad_index]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """Inverse of `pad`: [B, max_query_len, ...] -> [N, ...]."""
        flat = padded.reshape(-1, *padded.shape[2:])
        if self.query_len:
            return flat
        return flat[self.unpad_index]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None = None
    is_draft: bool = False


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


def require_metadata(layer: str) -> AttentionMetadata:
    """The current forward's metadata; a clear error when a layer runs outside one."""
    metadata = get_forward_context().attn_metadata
    if metadata is None:
        raise RuntimeError(
            f"{layer} needs attention metadata: run the forward inside "
            "set_forward_context(ForwardContext(metadata))"
        )
    return metadata
