"""RMSNorm computed in fp32, plain (x̂ * w) or Gemma-style (x̂ * (1 + w)).

On CUDA the norm runs as one Triton kernel (`atom/kernels/rms_norm.py`); on CPU, and
wherever autograd needs the graph (training), as the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom.kernels import triton_available


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (weight.float() + weight_offset)).to(x.dtype)


def use_norm_kernel(x: torch.Tensor) -> bool:
    """Whether a norm of x runs as a Triton kernel (CUDA, no autograd, and not
    turned off by `ATOM_DISABLE_TRITON`, as every other kernel honours it)."""
    return x.is_cuda and not torch.is_grad_enabled() and triton_available(x.device)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    """x̂ * (w + weight_offset) in x.dtype, x̂ = x / rms(x) over the last dim."""
    if use_norm_kernel(x):
        from atom.kernels.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, weight_offset)
    return rms_norm_reference(x, weight, eps, weight_offset)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a decoder layer's add, then norm,
    as one kernel on CUDA."""
    if use_norm_kernel(x):
        from atom.kernels.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, weight_offset, residual=residual)
    summed = x + residual
    return rms_norm_reference(summed, weight, eps, weight_offset), summed


class RMSNorm(nn.Module):
    # What the norm multiplies by is weight + weight_offset.
    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.weight_offset)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)


class GemmaRMSNorm(RMSNorm):
    """The weight is an offset from 1 (zeros at init): x̂ * (1 + w), cast after the
    multiply. A plain RMSNorm on such a checkpoint would scale by w alone."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()


def pre_norm_attention(
    input_norm: RMSNorm,
    post_norm: RMSNorm,
    attention: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder layer up to its FFN: (the FFN's normed input, the residual
    stream after attention). The previous layer's output joins the stream in the
    input norm and the attention output in the post-attention norm (one kernel each
    on CUDA); the first layer's stream is its input."""
    if residual is None:
        stream = hidden_states
        x = input_norm(stream)
    else:
        x, stream = input_norm.add_and_norm(hidden_states, residual)
    return post_norm.add_and_norm(attention(positions, x), stream)
