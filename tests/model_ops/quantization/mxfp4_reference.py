"""A reference MXFP4 quantizer, the inverse of atom's loader-side dequantizer, for
writing test checkpoints.

It picks X = 2^(floor(log2 amax) - 2) per block of 32 (2 = e2m1's largest exponent),
as OCP MX v1.0 converts (torchao's FLOOR scale mode); the quotient is rounded to
nearest, ties to even, and saturates at 6.
"""

import torch

from atom.model_ops.quantization.mxfp4 import E8M0_BIAS, MXFP4_BLOCK, e8m0_to_float

E2M1_EMAX = 2
# Round-to-nearest boundaries between neighbouring magnitudes. At an exact midpoint
# the code with mantissa bit 0 (the even one) wins: `>=` where the upper neighbour
# is even, `>` where the lower one is.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True))
_MIDPOINTS += ((2.5, False), (3.5, True), (5.0, False))


def _e2m1_codes(quotient: torch.Tensor) -> torch.Tensor:
    magnitude = quotient.abs()
    index = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, up_is_even in _MIDPOINTS:
        passed = magnitude >= midpoint if up_is_even else magnitude > midpoint
        index += passed.to(torch.uint8)
    return index | (torch.signbit(quotient).to(torch.uint8) << 3)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer: (packed uint8 [out, in/2], scale uint8 [out, in/32]).

    Round trip is exact for blocks that are e2m1 values times one power of two.
    """
    if weight.dim() != 2 or weight.shape[1] % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4 quantizes [out, in] with in a multiple of {MXFP4_BLOCK}, got "
            f"{tuple(weight.shape)}"
        )
    if not torch.isfinite(weight).all():
        raise ValueError("cannot MXFP4-quantize a weight holding Inf or NaN")
    rows, inner = weight.shape
    blocks = weight.float().view(rows, -1, MXFP4_BLOCK)
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2 amax) = e - 1.
    _, exponent = torch.frexp(blocks.abs().amax(dim=-1))
    shared = (exponent - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = (shared + E8M0_BIAS).to(torch.uint8)
    codes = _e2m1_codes(blocks / e8m0_to_float(scale).unsqueeze(-1))
    codes = codes.reshape(rows, inner // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, scale
