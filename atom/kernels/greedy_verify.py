"""Greedy verification of a step's drafts in one launch.

`rejection_sampler.verify_drafts` on the greedy rule (its reference here) spends a
dozen small torch operators on a few dozen integers: masks, the leading run of
matches, the token after it, the scatter into the emitted row. Between two graph
replays each is a launch the host pays for, so a DSpark step does them in one
program per block of sequences instead, reading the argmax of every scored row
(`logits.argmax(-1)`, taken before any [S, T + 1, V] gather) and writing straight
into the step's packed host fetch (`step_sampler.StepSampler.launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Sequences per program: a verify step's integers fit one program up to here.
_BLOCK_S = 16


@triton.jit
def _greedy_verify_kernel(
    best_ptr,
    row_index_ptr,
    drafts_ptr,
    num_drafts_ptr,
    positions_ptr,
    out_ptr,
    anchor_positions_ptr,
    num_seqs,
    T,
    out_stride,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, BLOCK_W)
    s_ok = s < num_seqs
    row_ok = s_ok[:, None] & (j[None, :] <= T)
    draft_ok = s_ok[:, None] & (j[None, :] < T)
    rows = tl.load(row_index_ptr + s[:, None] * (T + 1) + j[None, :], row_ok, other=0)
    best = tl.load(best_ptr + rows, row_ok, other=-1)
    drafts = tl.load(drafts_ptr + s[:, None] * T + j[None, :], draft_ok, other=0)
    counts = tl.load(num_drafts_ptr + s, s_ok, other=0)
    kept = draft_ok & (j[None, :] < counts[:, None]) & (best == drafts)
    # The first column that is not a kept draft: column T never is, so <= T.
    accepted = tl.min(tl.where(kept, BLOCK_W, j[None, :]), axis=1)
    at_stop = j[None, :] == accepted[:, None]
    final = tl.sum(tl.where(at_stop, best, 0), axis=1)
    # Past the stop the row keeps its drafts (0 in column T), as the reference.
    emitted = tl.where(at_stop, final[:, None], drafts)
    row_out = out_ptr + s * out_stride
    tl.store(row_out, accepted, s_ok)
    tl.store(row_out[:, None] + 1 + j[None, :], emitted, row_ok)
    tl.store(row_out + 2 + T, final, s_ok)
    positions = tl.load(positions_ptr + s, s_ok, other=0)
    tl.store(anchor_positions_ptr + s, positions + accepted, s_ok)


def greedy_verify(
    best: torch.Tensor,
    row_index: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Verify every sequence's drafts by the greedy rule; the anchors' positions [S].

    best: [R] long, the argmax of each scored logits row; row_index [S, T + 1]
    long, the rows of each sequence's verify positions; draft_ids [S, T] and
    num_drafts [S] long, as `verify_drafts` takes them; positions [S] long, the
    position of each sequence's first draft. out: [S, >= T + 3] long, whose
    columns 0, 1 .. T + 1 and T + 2 receive the accepted count, the emitted row
    (`verify_drafts`' `emitted`) and the anchor (the last emitted token); the
    anchor sits at position `positions + accepted`, which is returned.
    """
    num_seqs, width = draft_ids.shape
    if tuple(row_index.shape) != (num_seqs, width + 1):
        raise ValueError(
            f"row_index must be [{num_seqs}, {width + 1}], got {tuple(row_index.shape)}"
        )
    if out.shape[0] != num_seqs or out.shape[1] < width + 3 or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{num_seqs}, >= {width + 3}] with unit column stride, got "
            f"{tuple(out.shape)} strides {out.stride()}"
        )
    anchor_positions = torch.empty_like(positions)
    if num_seqs:
        _greedy_verify_kernel[(triton.cdiv(num_seqs, _BLOCK_S),)](
            best,
            row_index.contiguous(),
            draft_ids.contiguous(),
            num_drafts,
            positions,
            out,
            anchor_positions,
            num_seqs,
            width,
            out.stride(0),
            BLOCK_S=_BLOCK_S,
            BLOCK_W=triton.next_power_of_2(width + 1),
        )
    return anchor_positions
