"""The routed experts' weighted sum in Triton: each token's k expert rows, read
through their sorted positions, weighted and summed in fp32, in one launch.

The torch reference is `atom.model_ops.grouped_experts.combine_expert_rows` (a
gather, a cast, a product and a sum, four kernels and two [N*k, D] intermediates).
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
    out_ptr,
    width,
    stride_y,
    TOP_K: tl.constexpr,
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
    tl.store(out_ptr + token * width + cols, acc, mask=inside)


def combine_expert_rows_triton(
    y: torch.Tensor, position: torch.Tensor, routing_weights: torch.Tensor
) -> torch.Tensor:
    """[T, D] fp32: sum_j routing_weights[t, j] * y[position[t * k + j]]."""
    num_tokens, top_k = routing_weights.shape
    width = y.shape[-1]
    if y.stride(-1) != 1:
        y = y.contiguous()
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=y.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(width))
        _combine_kernel[(num_tokens, triton.cdiv(width, block))](
            y,
            position,
            routing_weights.contiguous(),
            out,
            width,
            y.stride(0),
            TOP_K=top_k,
            BLOCK=block,
        )
    return out
