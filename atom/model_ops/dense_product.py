"""x W^T (+ b): the one place a dense, unquantized product picks its kernel.

A decode step's products have one row a sequence. For the small weights among them
(KDA's low-rank gate up-projections, the router, the write strength) a product is
bound by cuBLAS's latency, and its fp32 GEMVs cost a cast and two kernels more;
there the skinny GEMM (`atom/kernels/skinny_gemm.py`) saved 2-4 us a product (H100,
`benchmarks/bench_skinny_gemm.py`, 2026-12-06). For larger weights cuBLAS reads W
faster (the kernel reached 0.63-0.92x its speed at one row, far less at eight), so
they stay with cuBLAS. The kernel runs on a GPU, for half precision activations
(fp32 models keep cuBLAS, whose products the transformers comparisons match
exactly), without autograd, and at up to `skinny_max_rows` rows (a few, or a decode
batch's for a narrow weight): shape facts, so a captured graph always takes the
same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import triton_available

_HALF = (torch.bfloat16, torch.float16)
# The largest weight (elements) the skinny GEMM takes: 128 x 2304 and 2048 x 128
# gained, 576 x 2304 lost at eight rows.
_SKINNY_MAX_WEIGHT = 1 << 19


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] W [N, K]^T (+ bias) in `out_dtype` (x's by default). W may be wider
    than x's dtype (fp32 router weights): x is then taken at W's precision."""
    if _skinny(x, weight):
        from atom.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias, out_dtype)
    return F.linear(x.to(weight.dtype), weight, bias).to(out_dtype or x.dtype)


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    from atom.kernels.skinny_gemm import skinny_max_rows

    return (
        x.is_cuda
        and weight.numel() <= _SKINNY_MAX_WEIGHT
        and x.dtype in _HALF
        and not torch.is_grad_enabled()
        and x.numel() <= skinny_max_rows(weight.shape[0]) * x.shape[-1]
        and triton_available(x.device)
    )
