"""Attention Residuals (AttnRes) mix (arXiv 2603.15031; docs/kimi_k3.md).

A softmax over the closed blocks and the current partial sum, scored by a learned
projection of each RMS-normalised candidate, replaces the residual stream in K3.
Every mix feeds an RMSNorm (a layer's input norms, the final norm): on CUDA the mix
and that norm run as one Triton kernel (`atom/kernels/attn_res_mix.py`); on CPU, and
wherever autograd needs the graph (training), as the torch reference.
"""

import torch

from atom.kernels import triton_available
from atom.model_ops.layernorm import RMSNorm


def attn_res_mix(
    bank: torch.Tensor | None,
    partial: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Mix of bank [T, nB, H] blocks and partial [T, H] (last candidate), in torch.

    score_j = sum_d c_j * w_n * w_p / sqrt(mean(c_j^2) + eps); alpha = softmax(score);
    mix = sum_j alpha_j * c_j over the raw candidates, in fp32, returned in
    partial.dtype. With no bank blocks the result is `partial` itself.
    """
    if not _has_blocks(bank, partial, norm_weight, proj_weight):
        return partial
    hidden = partial.shape[1]
    candidates = torch.cat([bank.float(), partial.float().unsqueeze(1)], dim=1)
    # The norm weight and the 1-row projection fold into one scoring vector.
    score_vector = norm_weight.float().reshape(hidden) * proj_weight.float().reshape(
        hidden
    )
    inv_rms = torch.rsqrt(candidates.pow(2).mean(dim=-1) + eps)
    scores = (candidates @ score_vector) * inv_rms
    weights = torch.softmax(scores, dim=1)
    mix = (weights.unsqueeze(-1) * candidates).sum(dim=1)
    return mix.to(partial.dtype)


def attn_res_mix_norm(
    bank: torch.Tensor | None,
    partial: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    out_norm: RMSNorm,
) -> torch.Tensor:
    """out_norm(attn_res_mix(bank, partial, ...)), one kernel on CUDA."""
    if _use_kernel(partial) and _has_blocks(bank, partial, norm_weight, proj_weight):
        from atom.kernels.attn_res_mix import attn_res_mix_triton

        then = (out_norm.weight, out_norm.eps, out_norm.weight_offset)
        return attn_res_mix_triton(bank, partial, norm_weight, proj_weight, eps, then)
    return out_norm(attn_res_mix(bank, partial, norm_weight, proj_weight, eps))


def _has_blocks(
    bank: torch.Tensor | None,
    partial: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
) -> bool:
    """Whether the bank holds any block to mix; ValueErrors for shapes that disagree."""
    if partial.dim() != 2:
        raise ValueError(f"partial must be [T, H], got {tuple(partial.shape)}")
    tokens, hidden = partial.shape
    if bank is None or bank.shape[1] == 0:
        return False
    if bank.dim() != 3 or bank.shape[0] != tokens or bank.shape[2] != hidden:
        raise ValueError(
            f"bank must be [{tokens}, nB, {hidden}], got {tuple(bank.shape)}"
        )
    if norm_weight.numel() != hidden or proj_weight.numel() != hidden:
        raise ValueError(
            f"norm_weight {tuple(norm_weight.shape)} and proj_weight "
            f"{tuple(proj_weight.shape)} must each hold {hidden} values"
        )
    return True


def _use_kernel(partial: torch.Tensor) -> bool:
    return (
        partial.is_cuda
        and triton_available(partial.device)
        and not torch.is_grad_enabled()
    )
