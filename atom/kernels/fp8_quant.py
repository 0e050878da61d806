"""Per-token e4m3 quantization in Triton: codes and scales of every row in one launch.

The torch reference is `atom.model_ops.quantization.ptpc_fp8.quantize_rows`: each
row's scale is max(amax / 448, min_scale) and its codes are x / scale clamped to
+-448 and rounded to the nearest e4m3 value (ties to even). One program reads its
row twice (amax, then codes; the second read hits L2) instead of the five eager
torch kernels of the reference.

The kernel writes the codes as e4m3 bit patterns (uint8) that it encodes itself
after rounding in fp32, with IEEE divisions: the codes equal the reference's bit for
bit on any GPU, whether or not Triton has an e4m3 type there (it has none before
sm89), and under Triton's interpreter, whose fp32 -> e4m3 cast (Triton 3.9)
truncates subnormals and drops the rounding carry into the exponent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3 = torch.float8_e4m3fn
# Rows longer than this are read in several blocks.
_MAX_BLOCK = 4096


@triton.jit
def _e4m3_bits(v):
    """e4m3 bit patterns (int32) of fp32 `v` (|v| <= 448), rounded to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    # e4m3 keeps 3 mantissa bits down to its smallest normal, 2^-6, and steps by
    # 2^-9 below it. Adding 2^(exponent + 20) (exponent at least -6) moves that step
    # to fp32's last mantissa bit, so the add itself rounds to nearest even.
    biased = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    magic = ((biased + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic
    # Normal values: fp32's exponent rebiased (127 -> 7) and its top 3 mantissa
    # bits; subnormal ones count steps of 2^-9.
    normal = (rounded.to(tl.int32, bitcast=True) >> 20) - ((127 - 7) << 3)
    subnormal = (rounded * 512.0).to(tl.int32)
    magnitude = tl.where(rounded >= 0.015625, normal, subnormal)
    return tl.where(bits < 0, magnitude | 0x80, magnitude)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_codes,
    min_scale,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    codes_row = codes_ptr + row * stride_codes
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + cols
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE division, as torch divides: the default one is approximate on NVIDIA.
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + cols
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(codes_row + k, _e4m3_bits(q).to(tl.uint8), mask=k < K)


def quantize_rows_triton(
    x: torch.Tensor, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [M, K], fp32 scales [M, 1]) of x [M, K] (any float dtype, rows
    may be strided), as `quantize_rows` gives them with MIN_SCALE = min_scale."""
    num_rows, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty(num_rows, width, dtype=E4M3, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return codes, scale
    _quantize_rows_kernel[(num_rows,)](
        x,
        codes.view(torch.uint8),
        scale,
        width,
        x.stride(0),
        codes.stride(0),
        min_scale,
        FP8_MAX=torch.finfo(E4M3).max,
        BLOCK=min(triton.next_power_of_2(width), _MAX_BLOCK),
    )
    return codes, scale
