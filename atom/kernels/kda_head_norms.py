"""KDA's per-head normalizations in Triton: one program per (row, head), fp32 math.

Two places of a KDA layer normalize each head's vector, and in torch each costs a
handful of kernels (cast, square, sum, sqrt or rsqrt, divide, products):

- `l2_normalize_qk`: q and k after the short conv, both in one launch; the torch
  reference is `atom.model_ops.kda.l2_normalize` applied to each. The Triton decode
  kernel (`kda_decode.py`) normalizes its rows' q and k itself (`l2_normalized`),
  so decode and verify steps skip this launch.
- `output_norm_gate`: RMSNorm of the recurrence's output times sigmoid of the gate,
  written in the model's dtype; the reference is
  `atom.model_ops.kda.kda_output_norm_gate` followed by the cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The eps of q's and k's L2 norms, as `atom.model_ops.kda.l2_normalize` has it.
L2_EPS = 1e-6


@triton.jit
def _l2_normalize_qk_kernel(
    x_ptr,
    q_ptr,
    k_ptr,
    heads,
    stride_x,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q's heads first, then k's
    d = tl.arange(0, BLOCK)
    inside = d < DIM
    x = tl.load(x_ptr + row * stride_x + head * DIM + d, mask=inside, other=0.0)
    y = l2_normalized(x.to(tl.float32), eps)
    # As a vector: a scalar comparison does not combine with a mask.
    is_k = (d * 0 + head) >= heads
    offset = row * heads * DIM + tl.where(is_k, head - heads, head) * DIM + d
    tl.store(q_ptr + offset, y, mask=inside & ~is_k)
    tl.store(k_ptr + offset, y, mask=inside & is_k)


@triton.jit
def l2_normalized(x, eps):
    """fp32 x / sqrt(sum x^2 + eps) of one vector (zeros in masked lanes are
    neutral). Shared with the decode kernel (`kda_decode.py`)."""
    return x / tl.sqrt(tl.sum(x * x, axis=0) + eps)


def l2_normalize_qk(
    mixed: torch.Tensor, heads: int, head_dim: int, eps: float = L2_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) fp32 [..., heads, head_dim], each head scaled to unit length, from
    `mixed` [..., >= 2 * heads * head_dim] holding q's heads then k's."""
    lead = mixed.shape[:-1]
    rows = mixed.reshape(-1, mixed.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q = torch.empty(*lead, heads, head_dim, dtype=torch.float32, device=mixed.device)
    k = torch.empty_like(q)
    if rows.shape[0]:
        _l2_normalize_qk_kernel[(rows.shape[0], 2 * heads)](
            rows,
            q,
            k,
            heads,
            rows.stride(0),
            eps,
            DIM=head_dim,
            BLOCK=triton.next_power_of_2(head_dim),
        )
    return q, k


@triton.jit
def _output_norm_gate_kernel(
    o_ptr,
    w_ptr,
    gate_ptr,
    out_ptr,
    heads,
    stride_o,
    stride_gate,
    eps,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    inside = d < DIM
    o = tl.load(o_ptr + row * stride_o + head * DIM + d, mask=inside, other=0.0)
    o = o.to(tl.float32)
    w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate + head * DIM + d, mask=inside)
    normed = o * tl.rsqrt(tl.sum(o * o, axis=0) / DIM + eps) * w
    out = normed * tl.sigmoid(gate.to(tl.float32))
    tl.store(
        out_ptr + row * heads * DIM + head * DIM + d,
        out.to(out_ptr.dtype.element_ty),
        mask=inside,
    )


def output_norm_gate(
    o: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """RMSNorm(o_h) * w * sigmoid(gate_h) per head as [T, h * Dv] in `out_dtype`,
    for o [T, h, Dv] and gate [T, h * Dv] (rows may be strided)."""
    tokens, heads, dim = o.shape
    rows = o.reshape(tokens, heads * dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    gates = gate.reshape(tokens, heads * dim)
    if gates.stride(-1) != 1:
        gates = gates.contiguous()
    out = torch.empty(tokens, heads * dim, dtype=out_dtype, device=o.device)
    if tokens:
        _output_norm_gate_kernel[(tokens, heads)](
            rows,
            norm_weight,
            gates,
            out,
            heads,
            rows.stride(0),
            gates.stride(0),
            eps,
            DIM=dim,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out
