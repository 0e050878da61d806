"""KDA's short causal conv on decode / verify rows in Triton, in the conv-state pool.

The torch reference is `atom.model_ops.kda_backend.torch_conv_decode`: gather each
sequence's last K-1 inputs from its slot, `causal_conv1d` + SiLU over them and this
step's rows, the per-row states of `conv_state_after_each_row` on verify, scatter.
Here each program owns one sequence and BLOCK_C channels: every output row reads its
K taps straight from the slot (the history) or from this step's rows, so nothing is
gathered, padded, transposed or cast on the way; the state after the sequence's last
row (and on verify after every row) is written back to the slot in the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tap(x_base, stride_xt, state_base, index, c, c_ok, fresh, HISTORY: tl.constexpr):
    """Input `index` of the sequence's stream as fp32 [BLOCK_C]: the slot's history
    for index < HISTORY (zeros for a fresh sequence), else row index - HISTORY."""
    # As a vector: a scalar comparison may be a plain bool (the index is often a
    # compile-time number), which does not combine with a mask.
    in_history = (c * 0 + index) < HISTORY
    old = tl.load(state_base + c * HISTORY + index, mask=c_ok & in_history, other=0.0)
    old = tl.where(fresh, 0.0, old.to(tl.float32))
    new = tl.load(
        x_base + (index - HISTORY) * stride_xt + c,
        mask=c_ok & ~in_history,
        other=0.0,
    )
    return tl.where(in_history, old, new.to(tl.float32))


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    pool_ptr,
    snap_ptr,
    slot_ptr,
    context_lens_ptr,
    start_ptr,
    rows,
    channels,
    stride_xb,
    stride_xt,
    stride_pool,
    stride_snap_slot,
    stride_snap_row,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SNAPSHOTS: tl.constexpr,
):
    HISTORY: tl.constexpr = KERNEL - 1
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    fresh = tl.load(context_lens_ptr + seq) == 0
    state_base = pool_ptr + slot * stride_pool
    x_base = x_ptr + seq.to(tl.int64) * stride_xb
    length = tl.load(start_ptr + seq + 1) - tl.load(start_ptr + seq)
    for t in range(rows):
        acc = tl.zeros((BLOCK_C,), tl.float32)
        for j in tl.static_range(KERNEL):
            w = tl.load(w_ptr + c * KERNEL + j, mask=c_ok, other=0.0).to(tl.float32)
            tap = _tap(x_base, stride_xt, state_base, t + j, c, c_ok, fresh, HISTORY)
            acc += w * tap
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        at = (seq.to(tl.int64) * rows + t) * channels + c
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=c_ok)
        if SNAPSHOTS:
            snap = snap_ptr + slot * stride_snap_slot + t * stride_snap_row
            for i in tl.static_range(HISTORY):
                tap = _tap(
                    x_base, stride_xt, state_base, t + 1 + i, c, c_ok, fresh, HISTORY
                )
                tl.store(snap + c * HISTORY + i, tap, mask=c_ok)
    # The history after the last real row: stream inputs length .. length + K - 2.
    # Entry i reads input length + i > i, which no earlier store has replaced.
    for i in tl.static_range(HISTORY):
        tap = _tap(x_base, stride_xt, state_base, length + i, c, c_ok, fresh, HISTORY)
        tl.store(state_base + c * HISTORY + i, tap, mask=c_ok)


def kda_conv_decode_in_pool(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    snapshots: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x [B, T, C] (padded rows after each sequence's
    query_start_loc length) as [B, T, C] in x.dtype, continuing each sequence's
    history pool[slots] ([S, C, K-1], zeros where `context_lens` [B] is 0);
    pool[slots] then holds the last K-1 inputs of each sequence, and
    snapshots[slots, t] ([S, R, C, K-1]) the history after row t when given.
    weight [C, K]."""
    batch, rows, channels = x.shape
    kernel = weight.shape[-1]
    if tuple(pool.shape[1:]) != (channels, kernel - 1) or not pool.is_contiguous():
        raise ValueError(
            f"conv pool must be contiguous [S, {channels}, {kernel - 1}], got "
            f"{tuple(pool.shape)}"
        )
    if kernel & (kernel - 1):
        raise ValueError(f"conv width must be a power of two, got {kernel}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.reshape(channels, kernel).contiguous()
    y = torch.empty(batch, rows, channels, dtype=x.dtype, device=x.device)
    snap = pool if snapshots is None else snapshots
    block_c = min(256, triton.next_power_of_2(channels))
    _conv_decode_kernel[(batch, triton.cdiv(channels, block_c))](
        x,
        weight,
        y,
        pool,
        snap,
        slots,
        context_lens,
        query_start_loc,
        rows,
        channels,
        x.stride(0),
        x.stride(1),
        pool.stride(0),
        snap.stride(0),
        snap.stride(1) if snapshots is not None else 0,
        KERNEL=kernel,
        BLOCK_C=block_c,
        SNAPSHOTS=snapshots is not None,
    )
    return y
