"""Per-head RMSNorm, then NeoX rotary on the first channels, as one Triton kernel.

Attention with q/k norms (MiniMax-M3, the Qwen3 draft) normalizes each head of q and
k (and of the indexer's queries and keys) and then rotates the first `rotary_dim`
channels by position. In torch that is about sixteen kernels per tensor (the norm,
then casts, the angles, cos, sin, four products, two sums, two concatenations); here
one program per (row, head) reads the head once, normalizes it in fp32, rounds it to
the output dtype as the reference's norm does, rotates channel i with channel
i + rotary_dim / 2 using cos and sin of position x inverse frequency, and writes the
head once. The torch reference is `atom.model_ops.rotary_embedding.norm_and_rotate`
off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_norm_rope_kernel(
    x_ptr,
    w_ptr,
    positions_ptr,
    inv_freq_ptr,
    out_ptr,
    heads,
    stride_row,
    stride_head,
    eps,
    weight_offset,
    cos_sin_scale,
    DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    source = x_ptr + row * stride_row + head * stride_head
    target = out_ptr + (row * heads + head) * DIM
    d = tl.arange(0, BLOCK)
    inside = d < DIM
    x = tl.load(source + d, mask=inside, other=0.0).to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    w = tl.load(w_ptr + d, mask=inside, other=0.0).to(tl.float32) + weight_offset
    # The reference's norm writes the model's dtype before the rotation reads it.
    normed = (x * inverse * w).to(out_ptr.dtype.element_ty)
    # Channels past the rotated ones pass through.
    tl.store(target + d, normed, mask=inside & (d >= 2 * HALF))

    i = tl.arange(0, BLOCK_HALF)
    pair = i < HALF
    a = tl.load(source + i, mask=pair, other=0.0).to(tl.float32)
    b = tl.load(source + HALF + i, mask=pair, other=0.0).to(tl.float32)
    wa = tl.load(w_ptr + i, mask=pair, other=0.0).to(tl.float32) + weight_offset
    wb = tl.load(w_ptr + HALF + i, mask=pair, other=0.0).to(tl.float32) + weight_offset
    a = (a * inverse * wa).to(out_ptr.dtype.element_ty).to(tl.float32)
    b = (b * inverse * wb).to(out_ptr.dtype.element_ty).to(tl.float32)
    position = tl.load(positions_ptr + row).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + i, mask=pair, other=0.0)
    cos = tl.cos(angle) * cos_sin_scale
    sin = tl.sin(angle) * cos_sin_scale
    tl.store(target + i, a * cos - b * sin, mask=pair)
    tl.store(target + HALF + i, b * cos + a * sin, mask=pair)


def head_norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    cos_sin_scale: float,
) -> torch.Tensor:
    """[..., heads, dim] in x.dtype: each head of x RMS-normalized with
    weight + weight_offset, its first 2 * len(inv_freq) channels rotated NeoX-style
    at `positions` (one per row of the leading dims). x may be a strided view whose
    last dim is contiguous."""
    *lead, heads, dim = x.shape
    half = inv_freq.numel()
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, heads, dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out
    _head_norm_rope_kernel[(rows.shape[0], heads)](
        rows,
        weight,
        positions.reshape(-1),
        inv_freq,
        out,
        heads,
        rows.stride(0),
        rows.stride(1),
        eps,
        weight_offset,
        cos_sin_scale,
        DIM=dim,
        HALF=half,
        BLOCK=triton.next_power_of_2(dim),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out
