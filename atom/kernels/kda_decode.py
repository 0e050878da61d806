"""KDA decode / verify recurrence in Triton, reading and writing states in the pool.

The torch reference is `atom.model_ops.kda.recurrent_kda` wrapped by the gather and
scatter of `atom.model_ops.kda_backend.TorchKDABackend.decode`. Here each program owns
one (sequence, head, BLOCK_V value rows) tile of the fp32 state [Dv, Dk]: it loads the
tile from the sequence's slot in the layer's state pool (zeros for a fresh sequence),
runs the few rows of this step through it, and writes the final tile back to the same
slot, so the state crosses memory once each way instead of through the gather, the
layout transposes and the scatter a library kernel needs around it. A verify step
also stores the state after every row into the slot's snapshot rows, for the commit
of the accepted prefix. Only elementwise math and row sums: no tensor-core shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    pool_ptr,
    snap_ptr,
    slot_ptr,
    context_lens_ptr,
    rows,
    heads,
    scale,
    q_sb,
    q_st,
    q_sh,
    k_sb,
    k_st,
    k_sh,
    v_sb,
    v_st,
    v_sh,
    g_sb,
    g_st,
    g_sh,
    beta_sb,
    beta_st,
    beta_sh,
    stride_pool,
    stride_snap_slot,
    stride_snap_row,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SNAPSHOTS: tl.constexpr,
):
    pair = tl.program_id(0)  # sequence * heads + head
    seq = pair // heads
    head = pair % heads
    v_rows = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, KEY_DIM)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    fresh = tl.load(context_lens_ptr + seq) == 0
    tile = v_rows[:, None] * KEY_DIM + keys[None, :]
    head_offset = head * VALUE_DIM * KEY_DIM
    state = tl.load(pool_ptr + slot * stride_pool + head_offset + tile)
    state = tl.where(fresh, 0.0, state)
    for t in range(rows):
        k_t = tl.load(k_ptr + _at(k_sb, k_st, k_sh, seq, t, head) + keys).to(tl.float32)
        q_t = tl.load(q_ptr + _at(q_sb, q_st, q_sh, seq, t, head) + keys).to(tl.float32)
        g_t = tl.load(g_ptr + _at(g_sb, g_st, g_sh, seq, t, head) + keys).to(tl.float32)
        v_t = tl.load(v_ptr + _at(v_sb, v_st, v_sh, seq, t, head) + v_rows).to(
            tl.float32
        )
        beta = tl.load(beta_ptr + _at(beta_sb, beta_st, beta_sh, seq, t, head)).to(
            tl.float32
        )
        state = state * tl.exp(g_t)[None, :]
        predicted = tl.sum(state * k_t[None, :], axis=1)
        state += (beta * (v_t - predicted))[:, None] * k_t[None, :]
        out = tl.sum(state * (q_t * scale)[None, :], axis=1)
        row = (seq * rows + t) * heads + head  # o is contiguous [B, T, h, Dv]
        tl.store(o_ptr + row * VALUE_DIM + v_rows, out)
        if SNAPSHOTS:
            at = slot * stride_snap_slot + t * stride_snap_row + head_offset
            tl.store(snap_ptr + at + tile, state)
    tl.store(pool_ptr + slot * stride_pool + head_offset + tile, state)


@triton.jit
def _at(stride_b, stride_t, stride_h, seq, t, head):
    """Element offset of (sequence, row, head)."""
    return seq.to(tl.int64) * stride_b + t * stride_t + head * stride_h


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (any other strides are read as
    they are), else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def kda_decode_in_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    snapshots: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B, T, h, Dv] fp32; pool[slots] ([S, h, Dv, Dk] fp32) now holds each
    sequence's state after its T rows, and snapshots[slots, t] ([S, R, h, Dv, Dk])
    the state after row t when given. q, k, g [B, T, h, Dk] (q, k L2-normalised, g
    the log-decay), v [B, T, h, Dv], beta [B, T, h], in any float dtype and
    strides; a sequence whose `context_lens` [B] entry is 0 starts from zeros.
    Slots must be distinct, but for the scratch slot of graph padding."""
    batch, rows, heads, key_dim = k.shape
    value_dim = v.shape[3]
    expected = (heads, value_dim, key_dim)
    if pool.dtype != torch.float32 or tuple(pool.shape[1:]) != expected:
        raise ValueError(
            f"state pool must be fp32 [S, {heads}, {value_dim}, {key_dim}], got "
            f"{pool.dtype} {tuple(pool.shape)}"
        )
    if not pool.is_contiguous() or (
        snapshots is not None and not snapshots[0, 0].is_contiguous()
    ):
        raise ValueError("state pools must hold each slot's states contiguously")
    if key_dim & (key_dim - 1) or value_dim & (value_dim - 1):
        raise ValueError(f"head dims must be powers of two, got {key_dim}, {value_dim}")
    q, k, v, g = (_unit_last_stride(x) for x in (q, k, v, g))
    o = torch.empty(batch, rows, heads, value_dim, device=v.device)
    # Small batches split the value rows finer, so more programs share the work.
    block_v = min(value_dim, 16 if batch * heads < 256 else 32)
    snap = pool if snapshots is None else snapshots
    _kda_decode_kernel[(batch * heads, value_dim // block_v)](
        q,
        k,
        v,
        g,
        beta,
        o,
        pool,
        snap,
        slots,
        context_lens,
        rows,
        heads,
        key_dim**-0.5,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(g),
        *beta.stride(),
        pool.stride(0),
        snap.stride(0),
        snap.stride(1) if snapshots is not None else 0,
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_V=block_v,
        SNAPSHOTS=snapshots is not None,
    )
    return o
