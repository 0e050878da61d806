"""Flatten one batch of sequences into model inputs and attention metadata."""

from __future__ import annotations

import torch

from atom.model_engine.batch import SeqWork
from atom.utils.forward_context import AttentionMetadata


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The paged-KV slot of `position`: block_table[pos // bs] * bs + pos % bs."""
    index = position // block_size
    if index >= len(block_table):
        raise ValueError(
            f"position {position} needs block {index}, but the block table holds "
            f"{len(block_table)} blocks"
        )
    return block_table[index] * block_size + position % block_size


def prepare_inputs(
    seqs: list[SeqWork], block_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [N], positions [N], metadata) with sequences as consecutive rows."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    for work in seqs:
        if not work.token_ids:
            raise ValueError(f"sequence {work.seq_id} has no rows in this forward")
        if not 0 <= work.num_spec_tokens < len(work.token_ids):
            raise ValueError(
                f"sequence {work.seq_id}: num_spec_tokens={work.num_spec_tokens} "
                f"with {len(work.token_ids)} rows (rows are [last, d1..dT])"
            )
        token_ids.extend(work.token_ids)
        for position in work.positions:
            positions.append(position)
            slots.append(slot_of(work.block_table, position, block_size))
        query_start_loc.append(len(token_ids))
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        context_lens=[work.context_len for work in seqs],
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=[list(work.block_table) for work in seqs],
        state_slots=[work.state_slot for work in seqs],
        verify=[work.num_spec_tokens > 0 for work in seqs],
    )
    return (
        torch.tensor(token_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        metadata,
    )
