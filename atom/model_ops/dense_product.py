"""x W^T (+ b): the one place a dense, unquantized product picks its kernel.

A decode step's products have one row a sequence, and at a few rows they only read
W: there the skinny GEMM (`atom/kernels/skinny_gemm.py`) reads it near the memory
rate, where cuBLAS's tiles reach half of it or less. It runs on a GPU, for half
precision activations (fp32 models keep cuBLAS, whose products the transformers
comparisons match exactly), without autograd, and at up to `SKINNY_MAX_ROWS` rows,
a shape fact, so a captured graph always takes the same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import triton_available

_HALF = (torch.bfloat16, torch.float16)


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] W [N, K]^T (+ bias) in `out_dtype` (x's by default). W may be wider
    than x's dtype (fp32 router weights): x is then taken at W's precision."""
    if _skinny(x):
        from atom.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias, out_dtype)
    return F.linear(x.to(weight.dtype), weight, bias).to(out_dtype or x.dtype)


def _skinny(x: torch.Tensor) -> bool:
    from atom.kernels.skinny_gemm import SKINNY_MAX_ROWS

    return (
        x.is_cuda
        and x.dtype in _HALF
        and not torch.is_grad_enabled()
        and x.numel() <= SKINNY_MAX_ROWS * x.shape[-1]
        and triton_available(x.device)
    )
