"""Flatten one batch of sequences into model inputs and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

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


@dataclass(frozen=True)
class SeqPadding:
    """Dummy sequences that fill a batch up to a captured graph's size.

    Each has the batch's rows per sequence, writes its KV rows to `kv_slot` and its
    recurrent state to `state_slot` (scratch places no request owns), starts from a
    zero state and reads block 0 under the causal mask.
    """

    num_seqs: int
    kv_slot: int
    state_slot: int


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
    padding: SeqPadding | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [N], positions [N], metadata) with sequences as consecutive rows.

    Block tables are padded with block 0 (masked, never written) to the longest
    table, or to `table_width` blocks when a captured graph fixes the width.
    `padding` appends dummy sequences after the real ones (graph replay).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not seqs:
        raise ValueError("prepare_inputs needs at least one sequence")
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for work in seqs:
        _check_work(work)
        token_ids.extend(work.token_ids)
        for position in work.positions:
            positions.append(position)
            slots.append(slot_of(work.block_table, position, block_size))
    lengths = [work.num_rows for work in seqs]
    context_lens = [work.context_len for work in seqs]
    state_slots = [work.state_slot for work in seqs]
    tables = [work.block_table for work in seqs]
    if padding is not None:
        extra = padding.num_seqs - len(seqs)
        if extra < 0 or len(set(lengths)) != 1:
            raise ValueError(
                f"padding to {padding.num_seqs} sequences needs at most that many "
                f"sequences of one length, got lengths {lengths}"
            )
        rows = lengths[0]
        token_ids += [0] * (extra * rows)
        positions += list(range(rows)) * extra
        slots += [padding.kv_slot] * (extra * rows)
        lengths += [rows] * extra
        context_lens += [0] * extra
        state_slots += [padding.state_slot] * extra
        tables += [[]] * extra
    query_start_loc = [0, *accumulate(lengths)]
    max_query_len = max(lengths)
    uniform = all(n == max_query_len for n in lengths)
    width = max(len(table) for table in tables)
    if table_width is not None:
        if table_width < width:
            raise ValueError(
                f"table_width={table_width} is shorter than a block table of {width}"
            )
        width = table_width
    tables = [table + [0] * (width - len(table)) for table in tables]
    query_positions = [[c + r for r in range(max_query_len)] for c in context_lens]

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
        num_seqs=len(lengths),
        num_tokens=len(token_ids),
        max_query_len=max_query_len,
        query_len=max_query_len if uniform else 0,
        all_fresh=all(work.context_len == 0 for work in seqs),
        keeps_row_states=any(work.num_spec_tokens for work in seqs),
        query_start_loc=tensor(query_start_loc),
        context_lens=tensor(context_lens),
        fresh=torch.tensor(
            [c == 0 for c in context_lens], dtype=torch.bool, device=device
        ),
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        state_slots=tensor(state_slots),
        query_positions=tensor(query_positions),
        pad_index=pad_index,
        unpad_index=unpad_index,
    )
    return tensor(token_ids), tensor(positions), metadata
