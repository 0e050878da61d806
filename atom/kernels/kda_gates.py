"""KDA's gates in Triton: the per-channel forget gate and the per-head write
strength of a step's rows, in one launch, fp32 math.

The torch references are `atom.model_ops.kda.kda_forget_gate` (an exp, a cast, the
bias add, softplus or sigmoid, products: five or six kernels) and the sigmoid of the
write strength's logits. One program per (row, head) reads that head's low-rank
gate projection once and writes its log-decay row and its beta. The math is
`gate_values`, which the Triton decode kernel (`kda_decode.py`) also runs on its
rows: on decode and verify steps this launch is left out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_gates_kernel(
    f_ptr,
    a_log_ptr,
    dt_bias_ptr,
    b_ptr,
    decay_ptr,
    beta_ptr,
    heads,
    stride_f,
    stride_b,
    lower_bound,
    BOUNDED: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    inside = d < DIM
    f = tl.load(f_ptr + row * stride_f + head * DIM + d, mask=inside, other=0.0)
    bias = tl.load(dt_bias_ptr + head * DIM + d, mask=inside, other=0.0)
    b = tl.load(b_ptr + row * stride_b + head)
    decay, beta = gate_values(
        f.to(tl.float32),
        bias.to(tl.float32),
        tl.load(a_log_ptr + head).to(tl.float32),
        b.to(tl.float32),
        lower_bound,
        BOUNDED,
    )
    tl.store(decay_ptr + (row * heads + head) * DIM + d, decay, mask=inside)
    tl.store(beta_ptr + row * heads + head, beta)


@triton.jit
def gate_values(f, dt_bias, a_log, b_logit, lower_bound, BOUNDED: tl.constexpr):
    """(log-decay, beta) of one head of one row, all fp32: f and dt_bias its
    channels, a_log and b_logit scalars. Shared with the decode kernel
    (`kda_decode.py`), which forms its gates in place."""
    pre = f + dt_bias
    rate = tl.exp(a_log)
    if BOUNDED:  # K3: lb * sigmoid(exp(A_log) * (f + dt_bias))
        decay = lower_bound * tl.sigmoid(rate * pre)
    else:  # Kimi Linear: -exp(A_log) * softplus(f + dt_bias), linear above 20
        softplus = tl.where(
            pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0)))
        )
        decay = -rate * softplus
    return decay, tl.sigmoid(b_logit)


def kda_gates_triton(
    f: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    b_logits: torch.Tensor,
    heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-decay [T, h, D] fp32, beta [T, h] fp32) from the gate projection f
    [T, h*D], A_log (its first h entries), dt_bias [h*D] and the write-strength
    logits [T, h]; `lower_bound` None selects Kimi Linear's softplus form."""
    tokens = f.shape[0]
    if f.stride(-1) != 1:
        f = f.contiguous()
    if b_logits.stride(-1) != 1:
        b_logits = b_logits.contiguous()
    decay = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=f.device)
    beta = torch.empty(tokens, heads, dtype=torch.float32, device=f.device)
    if tokens:
        _kda_gates_kernel[(tokens, heads)](
            f,
            a_log.reshape(-1),
            dt_bias.reshape(-1),
            b_logits,
            decay,
            beta,
            heads,
            f.stride(0),
            b_logits.stride(0),
            0.0 if lower_bound is None else lower_bound,
            BOUNDED=lower_bound is not None,
            DIM=head_dim,
            BLOCK=triton.next_power_of_2(head_dim),
        )
    return decay, beta
