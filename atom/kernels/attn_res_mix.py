"""The AttnRes mix in Triton: one program per token, an online softmax over its blocks.

The torch reference is `atom.model_ops.attn_res.attn_res_mix` (then, for the fused
norm, `atom.model_ops.layernorm.rms_norm_reference`). torch spends
about fifteen kernels on one mix (casts, the concatenation of bank and partial sum,
square, mean, rsqrt, the scoring product, softmax, the weighted sum, the cast back);
K3 mixes twice per layer, so in an eager prefill step those launches are a large
share of the host's time and in a decode graph a large share of its kernels. Here
each program reads every candidate row of its token once, scores it, folds it into
a running softmax-weighted sum in fp32 and writes the mix once. Every mix in K3 feeds
an RMSNorm (the layer's two input norms, the final norm), so the kernel applies that
norm too, to the mix rounded to the activation dtype as the unfused pair would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fold(c, score_vector, hidden, eps, best, total, mix):
    """Fold candidate row c (fp32) into the running (max score, weight sum, mix)."""
    inverse_rms = tl.rsqrt(tl.sum(c * c, axis=0) / hidden + eps)
    score = tl.sum(c * score_vector, axis=0) * inverse_rms
    new_best = tl.maximum(best, score)
    rescale = tl.exp(best - new_best)
    weight = tl.exp(score - new_best)
    return new_best, total * rescale + weight, mix * rescale + weight * c


@triton.jit
def _attn_res_mix_kernel(
    bank_ptr,
    partial_ptr,
    norm_ptr,
    proj_ptr,
    out_ptr,
    out_norm_ptr,
    blocks,
    hidden,
    stride_bank_token,
    stride_bank_block,
    stride_partial,
    eps,
    out_eps,
    out_weight_offset,
    NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    # The norm weight and the 1-row projection fold into one scoring vector.
    score_vector = tl.load(norm_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    score_vector *= tl.load(proj_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    mix = tl.zeros((BLOCK,), tl.float32)
    row = bank_ptr + token * stride_bank_token + cols
    for j in range(blocks):
        c = tl.load(row + j * stride_bank_block, mask=inside, other=0.0)
        best, total, mix = _fold(
            c.to(tl.float32), score_vector, hidden, eps, best, total, mix
        )
    # The partial sum is the last candidate.
    c = tl.load(partial_ptr + token * stride_partial + cols, mask=inside, other=0.0)
    best, total, mix = _fold(
        c.to(tl.float32), score_vector, hidden, eps, best, total, mix
    )
    mix = mix / total
    if NORM:
        mix = mix.to(out_ptr.dtype.element_ty).to(tl.float32)
        inverse_rms = tl.rsqrt(tl.sum(mix * mix, axis=0) / hidden + out_eps)
        w = tl.load(out_norm_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        mix = mix * inverse_rms * (w + out_weight_offset)
    tl.store(out_ptr + token * hidden + cols, mix, mask=inside)


def attn_res_mix_triton(
    bank: torch.Tensor,
    partial: torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
    out_norm: tuple[torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """The mix [T, H] in partial.dtype of bank [T, nB, H] (nB >= 1) and partial
    [T, H]; any token and block strides, contiguous hidden rows (copied if not).
    With `out_norm` = (weight, eps, weight_offset), the RMSNorm of the mix."""
    tokens, hidden = partial.shape
    if bank.stride(-1) != 1:
        bank = bank.contiguous()
    if partial.stride(-1) != 1:
        partial = partial.contiguous()
    out = torch.empty(tokens, hidden, dtype=partial.dtype, device=partial.device)
    if tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _attn_res_mix_kernel[(tokens,)](
        bank,
        partial,
        norm_weight.reshape(hidden),
        proj_weight.reshape(hidden),
        out,
        out_norm[0] if out_norm is not None else out,
        bank.shape[1],
        hidden,
        bank.stride(0),
        bank.stride(1),
        partial.stride(0),
        eps,
        out_norm[1] if out_norm is not None else 0.0,
        out_norm[2] if out_norm is not None else 0.0,
        NORM=out_norm is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out
