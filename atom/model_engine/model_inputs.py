"""Flatten one batch of sequences into model inputs and attention metadata.

The host builds every per-step integer tensor (token ids, positions, slots, block
tables, ...) inside one int64 buffer, which reaches the device in a single copy; the
inputs and the metadata are views of it. A captured graph keeps a static buffer of
the same layout and replays after one `copy_` of the new step's buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from atom.model_engine.batch import SeqWork
from atom.model_ops.host_copy import pinned
from atom.utils.forward_context import AttentionMetadata


@dataclass(frozen=True)
class SeqPadding:
    """Dummy sequences that fill a batch up to a captured graph's shape.

    Each writes its KV rows to `kv_slot` and its recurrent state to `state_slot`
    (scratch places no request owns), starts from a zero state and reads block 0
    under the causal mask. Without `num_tokens` each has the batch's rows per
    sequence (decode). With it the dummies hold the rows the batch leaves up to
    `num_tokens` (one each, the first the rest), and the query width is
    `num_tokens` whatever the real lengths, so the step's every shape depends on
    (num_seqs, num_tokens) alone (a short prefill).
    """

    num_seqs: int
    kv_slot: int
    state_slot: int
    num_tokens: int | None = None

    def dummy_lengths(self, lengths: list[int]) -> list[int]:
        """Rows of each dummy sequence after real sequences of `lengths`."""
        extra = self.num_seqs - len(lengths)
        if self.num_tokens is None:
            if extra < 0 or len(set(lengths)) != 1:
                raise ValueError(
                    f"padding to {self.num_seqs} sequences needs at most that many "
                    f"sequences of one length, got lengths {lengths}"
                )
            return [lengths[0]] * extra
        left = self.num_tokens - sum(lengths)
        if extra < 0 or left < extra or (extra == 0 and left):
            raise ValueError(
                f"padding to {self.num_seqs} sequences of {self.num_tokens} rows "
                f"cannot follow sequences of lengths {lengths}"
            )
        return [left - extra + 1] + [1] * (extra - 1) if extra else []


@dataclass(frozen=True)
class StepLayout:
    """Host facts of one step and where each tensor sits in its packed buffer."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    uniform: bool
    all_fresh: bool
    keeps_row_states: bool
    # (name, shape) in buffer order.
    fields: tuple[tuple[str, tuple[int, ...]], ...]

    def shape(self, name: str) -> tuple[int, ...]:
        return dict(self.fields)[name]

    def offset(self, name: str) -> int:
        """Where field `name` starts in the packed buffer (elements)."""
        start = 0
        for field, shape in self.fields:
            if field == name:
                return start
            start += math.prod(shape)
        raise KeyError(f"the step buffer has no field {name!r}")


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The paged-KV slot of `position`: block_table[pos // bs] * bs + pos % bs."""
    index = position // block_size
    if index >= len(block_table):
        raise ValueError(
            f"position {position} needs block {index}, but the block table holds "
            f"{len(block_table)} blocks"
        )
    return block_table[index] * block_size + position % block_size


def _check_work(work: SeqWork, block_size: int) -> None:
    if not work.token_ids:
        raise ValueError(f"sequence {work.seq_id} has no rows in this forward")
    if not 0 <= work.num_drafts < len(work.token_ids):
        raise ValueError(
            f"sequence {work.seq_id}: num_drafts={work.num_drafts} "
            f"with {len(work.token_ids)} rows (rows are [last, d1..dT])"
        )
    slot_of(work.block_table, work.context_len + work.num_rows - 1, block_size)


def _check_works(works: list[SeqWork], block_size: int) -> None:
    """`_check_work` for the batch, in one pass (it runs every step, and the
    per-work call with its slot arithmetic cost about 1 us a sequence): finds the
    first bad work, which `_check_work` then names."""
    bad = next(
        (
            work
            for work in works
            if not 0 <= work.num_drafts < len(work.token_ids)
            or (work.context_len + len(work.token_ids) - 1) // block_size
            >= len(work.block_table)
        ),
        None,
    )
    if bad is not None:
        _check_work(bad, block_size)


def build_step(
    works: list[SeqWork],
    block_size: int,
    table_width: int | None = None,
    padding: SeqPadding | None = None,
) -> tuple[torch.Tensor, StepLayout]:
    """(packed host buffer, layout) of one forward over `works`.

    Block tables are padded with block 0 (masked, never written) to the longest
    table, or to `table_width` blocks when a captured graph fixes the width.
    `padding` appends dummy sequences after the real ones (graph replay).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not works:
        raise ValueError("a forward needs at least one sequence")
    token_ids = [t for work in works for t in work.token_ids]
    lengths = [len(work.token_ids) for work in works]
    context_lens = [work.context_len for work in works]
    state_slots = [work.state_slot for work in works]
    tables = [work.block_table for work in works]
    _check_works(works, block_size)
    num_real_rows = len(token_ids)
    query_width = None
    if padding is not None:
        dummies = padding.dummy_lengths(lengths)
        token_ids += [0] * sum(dummies)
        lengths += dummies
        context_lens += [0] * len(dummies)
        state_slots += [padding.state_slot] * len(dummies)
        tables += [[]] * len(dummies)
        query_width = padding.num_tokens
    width = max(len(table) for table in tables)
    if table_width is not None:
        if table_width < width:
            raise ValueError(
                f"table_width={table_width} is shorter than a block table of {width}"
            )
        width = table_width
    num_seqs, num_tokens = len(lengths), len(token_ids)
    max_query_len = query_width or max(lengths)
    uniform = all(n == max_query_len for n in lengths)

    # numpy, not torch, for these small integer arrays: each torch op on the host
    # costs microseconds of dispatch, and a step builds a few dozen of them.
    long = np.int64
    lengths_a = np.array(lengths, dtype=long)
    context_a = np.array(context_lens, dtype=long)
    starts = np.zeros(num_seqs + 1, dtype=long)
    np.cumsum(lengths_a, out=starts[1:])
    tables_a = np.zeros((num_seqs, width), dtype=long)
    for row, table in zip(tables_a, tables):
        row[: len(table)] = table
    row_seq = np.repeat(np.arange(num_seqs), lengths_a)
    row_in_seq = np.arange(num_tokens) - starts[row_seq]
    positions = context_a[row_seq] + row_in_seq
    slots = tables_a[row_seq, positions // block_size] * block_size
    slots += positions % block_size
    if padding is not None:
        slots[num_real_rows:] = padding.kv_slot
    offsets = np.arange(max_query_len)
    named = {
        # First, so input_ids_of finds it without splitting the buffer.
        "input_ids": np.array(token_ids, dtype=long),
        "positions": positions,
        "query_start_loc": starts,
        "context_lens": context_a,
        "slot_mapping": slots,
        "block_tables": tables_a,
        "state_slots": np.array(state_slots, dtype=long),
        "query_positions": context_a[:, None] + offsets,
    }
    if not uniform:
        within = offsets[None, :] < lengths_a[:, None]
        named["pad_index"] = np.where(
            within, starts[:-1, None] + offsets, num_tokens
        ).astype(long)
        named["unpad_index"] = row_seq * max_query_len + row_in_seq
    layout = StepLayout(
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        max_query_len=max_query_len,
        uniform=uniform,
        all_fresh=all(work.context_len == 0 for work in works),
        keeps_row_states=any(work.num_drafts for work in works),
        fields=tuple((name, tuple(t.shape)) for name, t in named.items()),
    )
    packed = np.concatenate([array.reshape(-1) for array in named.values()])
    return torch.from_numpy(packed), layout


def view_step(
    packed: torch.Tensor, layout: StepLayout
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) as views of a packed buffer."""
    # One split, not a slice per field: each torch call costs dispatch time.
    pieces = packed.split([math.prod(shape) for _, shape in layout.fields])
    views = {
        name: piece.view(shape) for (name, shape), piece in zip(layout.fields, pieces)
    }
    metadata = AttentionMetadata(
        num_seqs=layout.num_seqs,
        num_tokens=layout.num_tokens,
        max_query_len=layout.max_query_len,
        query_len=layout.max_query_len if layout.uniform else 0,
        all_fresh=layout.all_fresh,
        keeps_row_states=layout.keeps_row_states,
        query_start_loc=views["query_start_loc"],
        context_lens=views["context_lens"],
        slot_mapping=views["slot_mapping"],
        block_tables=views["block_tables"],
        state_slots=views["state_slots"],
        query_positions=views["query_positions"],
        pad_index=views.get("pad_index"),
        unpad_index=views.get("unpad_index"),
    )
    return views["input_ids"], views["positions"], metadata


def input_ids_of(packed: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """The input ids of a packed buffer: its first field, without the other views
    (async scheduling writes them every step)."""
    return packed[: layout.num_tokens]


def prepare_inputs(
    works: list[SeqWork],
    block_size: int,
    device: torch.device | str,
    table_width: int | None = None,
    padding: SeqPadding | None = None,
    fill: Callable[[torch.Tensor, StepLayout], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [N], positions [N], metadata) with sequences as consecutive rows,
    on `device` after one host-to-device copy; `fill` then writes the rows still
    pending there (pending_tokens.py)."""
    packed, layout = build_step(works, block_size, table_width, padding)
    packed = to_device(packed, device)
    if fill is not None:
        fill(packed, layout)
    return view_step(packed, layout)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`; a GPU copy goes from pinned memory without blocking,
    so the host goes on to the step's sampling fields while it runs (a pageable
    copy holds the host until it is done). The caching host allocator keeps the
    pinned block until the copy has run."""
    if torch.device(device).type == "cpu":
        return host
    return pinned(host).to(device, non_blocking=True)
