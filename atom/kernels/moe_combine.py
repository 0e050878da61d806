"""The routed experts' weighted sum in Triton: each token's k expert rows, read
through their sorted positions, weighted and summed in fp32, in one launch.

The torch reference is `atom.model_ops.grouped_experts.combine_expert_rows` (a
gather, a cast, a product and a sum, four kernels and two [N*k, D] intermediates).
The sum may take an addend (the shared experts' output) and be written in the
model's dtype: at one rank that is the MoE block's output, so the add and the cast
that followed it are two launches a layer fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(
    y_ptr,
    position_ptr,
    weights_ptr,
    addend_ptr,
    out_ptr,
    width,
    stride_y,
    stride_addend,
    TOP_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        row = tl.load(position_ptr + token * TOP_K + choice).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + choice).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=inside, other=0.0)
        acc += weight * y.to(tl.float32)
    if HAS_ADDEND:
        extra = tl.load(addend_ptr + token * stride_addend + cols, mask=inside, other=0)
        acc += extra.to(tl.float32)
    tl.store(
        out_ptr + token * width + cols,
        acc.to(out_ptr.dtype.element_ty),
        mask=inside,
    )


def combine_expert_rows_triton(
    y: torch.Tensor,
    position: torch.Tensor,
    routing_weights: torch.Tensor,
    addend: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[T, D] in `out_dtype`: sum_j routing_weights[t, j] * y[position[t * k + j]]
    (+ addend[t]), summed in fp32 and rounded once."""
    num_tokens, top_k = routing_weights.shape
    width = y.shape[-1]
    if y.stride(-1) != 1:
        y = y.contiguous()
    if addend is not None and addend.stride(-1) != 1:
        addend = addend.contiguous()
    out = torch.empty(num_tokens, width, dtype=out_dtype, device=y.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(width))
        _combine_kernel[(num_tokens, triton.cdiv(width, block))](
            y,
            position,
            routing_weights.contiguous(),
            addend if addend is not None else out,
            out,
            width,
            y.stride(0),
            addend.stride(0) if addend is not None else 0,
            TOP_K=top_k,
            HAS_ADDEND=addend is not None,
            BLOCK=block,
        )
    return out
