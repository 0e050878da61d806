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


def _check_work(work: SeqWork) -> None:
    if not work.token_ids:
        raise ValueError(f"sequence {work.seq_id} has no rows in this forward")
    if not 0 <= work.num_spec_tokens < len(work.token_ids):
        raise ValueError(
            f"sequence {work.seq_id}: num_spec_tokens={work.num_spec_tokens} "
            f"with {len(work.token_ids)} rows (rows are [last, d1..dT])"
        )


def prepare_inputs(
    seqs: list[SeqWork],
    block_size: int,
    device: torch.device | str,
    table_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [N], positions [N], metadata) with sequences as consecutive rows.

    Block tables are padded with block 0 (masked, never written) to the longest
    table, or to `table_width` blocks when a captured graph fixes the width.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not seqs:
        raise ValueError("prepare_inputs needs at least one sequence")
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    for work in seqs:
        _check_work(work)
        token_ids.extend(work.token_ids)
        for position in work.positions:
            positions.append(position)
            slots.append(slot_of(work.block_table, position, block_size))
        query_start_loc.append(len(token_ids))
    lengths = [work.num_rows for work in seqs]
    max_query_len = max(lengths)
    uniform = all(n == max_query_len for n in lengths)
    width = max(len(work.block_table) for work in seqs)
    if table_width is not None:
        if table_width < width:
            raise ValueError(
                f"table_width={table_width} is shorter than a block table of {width}"
            )
        width = table_width
    tables = [work.block_table + [0] * (width - len(work.block_table)) for work in seqs]
    query_positions = [
        [work.context_len + r for r in range(max_query_len)] for work in seqs
    ]

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    pad_index = unpad_index = None
    if not uniform:
        num_tokens = len(token_ids)
        pad_index = tensor(
            [
                [start + r if r < n else num_tokens for r in range(max_query_len)]
                for start, n in zip(query_start_loc, lengths)
            ]
        )
        unpad_index = tensor(
            [b * max_query_len + r for b, n in enumerate(lengths) for r in range(n)]
        )
    metadata = AttentionMetadata(
        num_seqs=len(seqs),
        num_tokens=len(token_ids),
        max_query_len=max_query_len,
        query_len=max_query_len if uniform else 0,
        all_fresh=all(work.context_len == 0 for work in seqs),
        keeps_row_states=any(work.num_spec_tokens for work in seqs),
        query_start_loc=tensor(query_start_loc),
        context_lens=tensor([work.context_len for work in seqs]),
        fresh=torch.tensor(
            [work.context_len == 0 for work in seqs], dtype=torch.bool, device=device
        ),
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        state_slots=tensor([work.state_slot for work in seqs]),
        query_positions=tensor(query_positions),
        pad_index=pad_index,
        unpad_index=unpad_index,
    )
    return tensor(token_ids), tensor(positions), metadata
