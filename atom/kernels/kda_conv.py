"""KDA's short causal conv in Triton, in the conv-state pool: decode, verify and
prefill rows alike.

The torch reference is `atom.model_ops.kda_backend.torch_conv`: gather each
sequence's last K-1 inputs from its slot, `causal_conv1d` + SiLU over them and this
step's rows, the per-row states of `conv_state_after_each_row` on verify, scatter.
Here each program owns one sequence and BLOCK_C channels and walks the rows in tiles
of up to MAX_BLOCK_ROWS: every output row reads its K taps straight from the slot
(the history) or from this step's rows, so nothing is gathered, padded, transposed
or cast to fp32 in memory on the way (the torch form does all four, which made it a
tenth of a bf16 prefill's kernel time); the state after the sequence's last row (and
on verify after every row) is written back to the slot in the pool once every read
of the old one is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _tap(x_base, stride_xt, state_base, index, c, c_ok, fresh, HISTORY: tl.constexpr):
    """Input `index` of the sequence's stream as fp32 ([BLOCK_C], or [BLOCK_T,
    BLOCK_C] for a column of indices): the slot's history for index < HISTORY (zeros
    for a fresh sequence), else row index - HISTORY."""
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
def _conv_kernel(
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
    BLOCK_T: tl.constexpr,
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
    # [BLOCK_T, BLOCK_C] tiles of rows: `_tap` broadcasts a column of row indices
    # against the row of channels.
    cols = c[None, :]
    for first in range(0, rows, BLOCK_T):
        t = first + tl.arange(0, BLOCK_T)[:, None]
        ok = c_ok[None, :] & (t < rows)
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for j in tl.static_range(KERNEL):
            # One row of channels, broadcast over the tile's rows.
            w = tl.load(w_ptr + c * KERNEL + j, mask=c_ok, other=0.0).to(tl.float32)
            if first < HISTORY:  # the tile reads the slot's history too
                tap = _tap(
                    x_base, stride_xt, state_base, t + j, cols, ok, fresh, HISTORY
                )
            else:  # every tap is one of this step's rows: one load, no select
                tap = tl.load(
                    x_base + (t + j - HISTORY) * stride_xt + cols, mask=ok, other=0.0
                ).to(tl.float32)
            acc += w[None, :] * tap
        y = acc / (1.0 + tl.exp(-acc))  # SiLU
        at = (seq.to(tl.int64) * rows + t) * channels + cols
        tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=ok)
        if SNAPSHOTS:
            snap = snap_ptr + slot * stride_snap_slot + t * stride_snap_row
            for i in tl.static_range(HISTORY):
                tap = _tap(
                    x_base, stride_xt, state_base, t + 1 + i, cols, ok, fresh, HISTORY
                )
                tl.store(snap + cols * HISTORY + i, tap, mask=ok)
    # The tiles and the lines below spread channels over threads differently: every
    # thread's reads of the old history end before any thread overwrites it.
    tl.debug_barrier()
    # The history after the last real row: stream inputs length .. length + K - 2.
    # Entry i reads input length + i > i, which no earlier store has replaced.
    for i in tl.static_range(HISTORY):
        tap = _tap(x_base, stride_xt, state_base, length + i, c, c_ok, fresh, HISTORY)
        tl.store(state_base + c * HISTORY + i, tap, mask=c_ok)


@dataclass(frozen=True)
class ConvTiles:
    """A program's BLOCK_ROWS x BLOCK_CHANNELS tile and Triton's num_warps."""

    block_rows: int
    block_channels: int
    num_warps: int = 4


# Rows a program convolves at once: a prompt's rows in tiles, a decode row alone.
MAX_BLOCK_ROWS = 32
MAX_BLOCK_CHANNELS = 256


def default_conv_tiles(rows: int, channels: int) -> ConvTiles:
    """The tiles `kda_conv_in_pool` takes unless told (`benchmarks/tune_kda_conv.py`
    times the others)."""
    return ConvTiles(
        min(MAX_BLOCK_ROWS, triton.next_power_of_2(rows)),
        min(MAX_BLOCK_CHANNELS, triton.next_power_of_2(channels)),
    )


def kda_conv_in_pool(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    snapshots: torch.Tensor | None = None,
    tiles: ConvTiles | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x [B, T, C] (padded rows after each sequence's
    query_start_loc length) as [B, T, C] in x.dtype, continuing each sequence's
    history pool[slots] ([S, C, K-1], zeros where `context_lens` [B] is 0);
    pool[slots] then holds the last K-1 inputs of each sequence, and
    snapshots[slots, t] ([S, R, C, K-1]) the history after row t when given.
    weight [C, K]; `tiles` defaults to `default_conv_tiles`."""
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
    tiles = tiles or default_conv_tiles(rows, channels)
    _conv_kernel[(batch, triton.cdiv(channels, tiles.block_channels))](
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
        BLOCK_T=tiles.block_rows,
        BLOCK_C=tiles.block_channels,
        SNAPSHOTS=snapshots is not None,
        num_warps=tiles.num_warps,
    )
    return y
