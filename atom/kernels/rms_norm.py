"""RMSNorm in Triton: one program per row, the whole row in registers, fp32 math.

The torch reference is `atom.model_ops.layernorm.rms_norm_reference`. Where torch
runs seven kernels per norm (cast, square, mean, add, rsqrt, two multiplies and the
cast back), this reads the row once and writes it once; with `residual` it also adds
the residual stream first and returns the sum, the other half of a decoder layer's
"add, then norm".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    w_ptr,
    out_ptr,
    width,
    stride_x,
    stride_residual,
    eps,
    weight_offset,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if ADD_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_residual + cols, mask=inside, other=0)
        tl.store(sum_ptr + row * width + cols, x, mask=inside)
        x = x.to(sum_ptr.dtype.element_ty)  # the norm reads the stored sum
    xf = x.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32) + weight_offset
    tl.store(out_ptr + row * width + cols, xf * inverse * w, mask=inside)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) in x.dtype over the last dim, or with `residual` (norm(x + residual),
    x + residual). Rows may be strided; the last dim must be contiguous."""
    width = x.shape[-1]
    rows = x.reshape(-1, width) if x.stride(-1) == 1 else x.contiguous().view(-1, width)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = out
    extra = rows
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}"
            )
        extra = residual.reshape(-1, width)
        if extra.stride(-1) != 1:
            extra = extra.contiguous()
        summed = torch.empty_like(out)
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        extra,
        summed,
        weight,
        out,
        width,
        rows.stride(0),
        extra.stride(0),
        eps,
        weight_offset,
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out if residual is None else (out, summed)
