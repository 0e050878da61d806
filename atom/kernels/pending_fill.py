"""A step's pending rows put right on the device in one launch.

`pending_tokens.PendingRows.fill` (its torch form is the reference) writes the
inputs async scheduling left pending and, after a verify, takes each sequence's
rejected drafts back from its positions, slots, context length and query
positions: about a dozen small operators, each a launch the host pays for between
two graph replays. Here one program per pending work does all of it in the packed
step buffer (`model_inputs.build_step`'s layout: `StepLayout.offset` names where
each field starts) and writes the rejected counts the sampler's repair reads next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from atom.model_engine.model_inputs import StepLayout


@triton.jit
def _pending_fill_kernel(
    packed_ptr,
    next_inputs_ptr,
    accepted_ptr,
    works_ptr,
    firsts_ptr,
    sources_ptr,
    unconfirmed_ptr,
    rejected_ptr,
    rows,
    unconfirmed_all,
    next_stride,
    accepted_stride,
    positions_at,
    context_at,
    slots_at,
    tables_at,
    table_width,
    query_at,
    query_width,
    block_size,
    IN_ORDER: tl.constexpr,
    ONE_COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    p = tl.program_id(0)
    if IN_ORDER:
        # Steady decode: pending work p leads both batches at row p.
        work, source, first = p, p, p * rows
    else:
        work = tl.load(works_ptr + p)
        source = tl.load(sources_ptr + p)
        first = tl.load(firsts_ptr + p)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rows
    tokens = tl.load(next_inputs_ptr + source * next_stride + r, r_ok)
    tl.store(packed_ptr + first + r, tokens, r_ok)  # input_ids lead the buffer
    if ONE_COUNT:
        unconfirmed = unconfirmed_all
    else:
        unconfirmed = tl.load(unconfirmed_ptr + p)
    rejected = unconfirmed - tl.load(accepted_ptr + source * accepted_stride)
    tl.store(rejected_ptr + p, rejected)
    position_of = packed_ptr + positions_at + first + r
    positions = tl.load(position_of, r_ok) - rejected
    tl.store(position_of, positions, r_ok)
    table = packed_ptr + tables_at + work * table_width
    blocks = tl.load(table + positions // block_size, r_ok, other=0)
    slots = blocks * block_size + positions % block_size
    tl.store(packed_ptr + slots_at + first + r, slots, r_ok)
    context_of = packed_ptr + context_at + work
    tl.store(context_of, tl.load(context_of) - rejected)
    q = tl.arange(0, BLOCK_Q)
    q_ok = q < query_width
    query_of = packed_ptr + query_at + work * query_width + q
    tl.store(query_of, tl.load(query_of, q_ok) - rejected, q_ok)


def pending_fill(
    packed: torch.Tensor,
    layout: StepLayout,
    block_size: int,
    next_inputs: torch.Tensor,
    accepted: torch.Tensor,
    rows: int,
    selection: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | int,
    unconfirmed: torch.Tensor | int,
) -> torch.Tensor:
    """`PendingRows.fill`'s writes to the step buffer `packed` after a verify; the
    drafts each pending work's context counted but the verify rejected [P].

    next_inputs [S', 1 + T] and accepted [S'] are the previous batch's (any row
    stride); every pending work takes `rows` inputs. `selection` is either the
    count P of works leading both batches in one order (steady decode), or
    (works, first token rows, sources) [P] long device tensors. `unconfirmed` is
    the drafts each work's context counted as accepted: one int for all, or [P].
    """
    if next_inputs.shape[1] < rows or (rows > 1 and next_inputs.stride(1) != 1):
        raise ValueError(
            f"next_inputs {tuple(next_inputs.shape)} (strides {next_inputs.stride()})"
            f" cannot give {rows} unit-stride rows a work"
        )
    in_order = isinstance(selection, int)
    works, firsts, sources = (packed,) * 3 if in_order else selection
    count = selection if in_order else works.shape[0]
    one_count = not isinstance(unconfirmed, torch.Tensor)
    rejected = torch.empty(count, dtype=torch.long, device=packed.device)
    if count == 0:
        return rejected
    table_width = layout.shape("block_tables")[1]
    query_width = layout.shape("query_positions")[1]
    _pending_fill_kernel[(count,)](
        packed,
        next_inputs,
        accepted,
        works,
        firsts,
        sources,
        packed if one_count else unconfirmed,
        rejected,
        rows,
        unconfirmed if one_count else 0,
        next_inputs.stride(0),
        accepted.stride(0),
        layout.offset("positions"),
        layout.offset("context_lens"),
        layout.offset("slot_mapping"),
        layout.offset("block_tables"),
        table_width,
        layout.offset("query_positions"),
        query_width,
        block_size,
        IN_ORDER=in_order,
        ONE_COUNT=one_count,
        BLOCK_R=triton.next_power_of_2(rows),
        BLOCK_Q=triton.next_power_of_2(query_width),
    )
    return rejected
