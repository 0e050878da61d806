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

`kda_decode_raw_in_pool` takes the rows as the conv and the gate projections left
them: the kernel L2-normalises each head's q and k (`kda_head_norms.l2_normalized`)
and forms the log-decay and beta (`kda_gates.gate_values`) itself, in the fp32 math
of those modules' kernels, so a decode or verify step launches neither of them: two
launches a KDA layer fewer, which at batch 1 cost more than their arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom.kernels.kda_gates import gate_values
from atom.kernels.kda_head_norms import L2_EPS, l2_normalized


@triton.jit
def _kda_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,  # g [B, T, h, Dk]; RAW: the forget gate's projection f [N, h * Dk]
    beta_ptr,  # beta [B, T, h]; RAW: its logits [N, h]
    a_log_ptr,  # RAW only, as are dt_bias and the sequences' first rows
    dt_bias_ptr,
    starts_ptr,
    o_ptr,
    pool_ptr,
    snap_ptr,
    slot_ptr,
    context_lens_ptr,
    rows,
    heads,
    scale,
    lower_bound,
    eps,
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
    RAW: tl.constexpr,
    BOUNDED: tl.constexpr,
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
    if RAW:  # the gate inputs are flat rows: this sequence's start at `first`
        first = tl.load(starts_ptr + seq).to(tl.int64)
        count = tl.load(starts_ptr + seq + 1) - first
        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head * KEY_DIM + keys).to(tl.float32)
    for t in range(rows):
        k_t = tl.load(k_ptr + _at(k_sb, k_st, k_sh, seq, t, head) + keys).to(tl.float32)
        q_t = tl.load(q_ptr + _at(q_sb, q_st, q_sh, seq, t, head) + keys).to(tl.float32)
        v_t = tl.load(v_ptr + _at(v_sb, v_st, v_sh, seq, t, head) + v_rows).to(
            tl.float32
        )
        if RAW:
            real = t < count
            f = tl.load(
                g_ptr + (first + t) * g_st + head * g_sh + keys,
                mask=(keys * 0 + t) < count,  # a vector mask, as the loads need
                other=0.0,
            )
            b = tl.load(
                beta_ptr + (first + t) * beta_st + head * beta_sh, mask=real, other=0.0
            )
            g_t, beta = gate_values(
                f.to(tl.float32), dt_bias, a_log, b.to(tl.float32), lower_bound, BOUNDED
            )
            # Rows past the sequence's own are padding: g = 0 and beta = 0 leave
            # the state as it was, as the zero rows `pad` gives the separate gates.
            g_t = tl.where(real, g_t, 0.0)
            beta = tl.where(real, beta, 0.0)
            q_t = l2_normalized(q_t, eps)
            k_t = l2_normalized(k_t, eps)
        else:
            g_t = tl.load(g_ptr + _at(g_sb, g_st, g_sh, seq, t, head) + keys).to(
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


class _RawGates(NamedTuple):
    """What the kernel needs, besides the rows, to form g and beta itself."""

    a_log: torch.Tensor
    dt_bias: torch.Tensor
    starts: torch.Tensor  # [B + 1] each sequence's first row of f and b_logits
    lower_bound: float | None
    eps: float  # of q's and k's L2 norms


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
    return _launch(q, k, v, g, beta, pool, slots, context_lens, snapshots, None)


def kda_decode_raw_in_pool(
    conved: torch.Tensor,
    f: torch.Tensor,
    b_logits: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    query_start_loc: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    snapshots: torch.Tensor | None = None,
    eps: float = L2_EPS,
) -> torch.Tensor:
    """`kda_decode_in_pool` from a step's raw inputs, which the kernel prepares as
    `l2_normalize_qk` and `kda_gates_triton` do, in the same fp32 math: the conv's
    output conved [B, T, 3 * h * Dk] (q, k, v side by side, Dv = Dk; q and k not
    yet normalised), the forget gate's low-rank projection f [N, h * Dk] and beta's
    logits b_logits [N, h] as flat rows, sequence b's at query_start_loc[b] up to
    query_start_loc[b + 1] (conved's rows past them are padding and leave the
    state alone), A_log (its first h entries) and dt_bias [h * Dk]; `lower_bound`
    None selects Kimi Linear's softplus gate, a number K3's bounded one."""
    batch, rows = conved.shape[:2]
    heads = b_logits.shape[-1]
    width = conved.shape[-1] // 3
    q, k, v = (
        part.reshape(batch, rows, heads, width // heads)
        for part in conved.split(width, dim=-1)
    )
    raw = _RawGates(
        a_log.reshape(-1), dt_bias.reshape(-1), query_start_loc, lower_bound, eps
    )
    return _launch(q, k, v, f, b_logits, pool, slots, context_lens, snapshots, raw)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    snapshots: torch.Tensor | None,
    raw: _RawGates | None,
) -> torch.Tensor:
    """The kernel over prepared inputs, or with `raw` over raw ones (g and beta
    then hold f and b_logits)."""
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
    if raw is None:
        gate_strides = (*_strides(g), *beta.stride())
    else:  # flat rows: no sequence stride; each head's Dk channels side by side
        gate_strides = (0, g.stride(0), key_dim, 0, *beta.stride())
    # Without RAW these are never read: any pointers do.
    gates = raw if raw is not None else _RawGates(g, g, slots, None, 0.0)
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
        gates.a_log,
        gates.dt_bias,
        gates.starts,
        o,
        pool,
        snap,
        slots,
        context_lens,
        rows,
        heads,
        key_dim**-0.5,
        0.0 if gates.lower_bound is None else gates.lower_bound,
        gates.eps,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *gate_strides,
        pool.stride(0),
        snap.stride(0),
        snap.stride(1) if snapshots is not None else 0,
        KEY_DIM=key_dim,
        VALUE_DIM=value_dim,
        BLOCK_V=block_v,
        SNAPSHOTS=snapshots is not None,
        RAW=raw is not None,
        BOUNDED=gates.lower_bound is not None,
    )
    return o
