"""Gated FFN activations in Triton: act(gate) * up in one pass, fp32 math.

The torch references are the modules of `atom.model_ops.activation` (SiLU, SiTU,
SwiGLU-OAI), which take the packed `[..., 2I]` projection, gate half first. In torch
SiLU costs two kernels and SiTU about ten (casts, tanh, sigmoid, products); here
each row's gate and up halves are read once and the product written once, rounded
once to the input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Each activation's compile-time switch in the kernel.
ACTIVATIONS = {"silu": 0, "situ": 1, "swiglu_oai": 2}


@triton.jit
def _tanh(x):
    # tanh through exp of a non-positive argument: no overflow at large |x|.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def gated_activation(gate, up, p0, p1, ACT: tl.constexpr, HAS_P1: tl.constexpr):
    """act(gate) * up of fp32 tiles (ACTIVATIONS names ACT); also the epilogue of
    the grouped expert GEMM that fuses it (`expert_gemm.py`)."""
    if ACT == 0:  # SiLU: gate * sigmoid(gate) * up
        out = gate * tl.sigmoid(gate) * up
    elif ACT == 1:  # SiTU: p0 = beta, p1 = linear beta (if any)
        out = p0 * _tanh(gate / p0) * tl.sigmoid(gate)
        if HAS_P1:
            up = p1 * _tanh(up / p1)
        out = out * up
    else:  # SwiGLU-OAI: p0 = alpha, p1 = limit
        gate = tl.minimum(gate, p1)
        up = tl.minimum(tl.maximum(up, -p1), p1)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * p0))
    return out


@triton.jit
def _gated_act_kernel(
    x_ptr,
    out_ptr,
    inner,
    stride_x,
    p0,
    p1,
    ACT: tl.constexpr,
    HAS_P1: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=inside, other=0.0)
    out = gated_activation(gate.to(tl.float32), up.to(tl.float32), p0, p1, ACT, HAS_P1)
    tl.store(
        out_ptr + row * inner + cols, out.to(out_ptr.dtype.element_ty), mask=inside
    )


def gated_act_triton(
    x: torch.Tensor, act: str, p0: float = 0.0, p1: float | None = None
) -> torch.Tensor:
    """act(gate) * up of x [..., 2I] as [..., I] in x's dtype; `act` is "silu",
    "situ" (p0 beta, p1 linear beta or None) or "swiglu_oai" (p0 alpha, p1 limit)."""
    inner = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inner)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inner, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inner))
    _gated_act_kernel[(rows.shape[0], triton.cdiv(inner, block))](
        rows,
        out,
        inner,
        rows.stride(0),
        p0,
        1.0 if p1 is None else p1,
        ACT=ACTIVATIONS[act],
        HAS_P1=p1 is not None,
        BLOCK=block,
    )
    return out
