"""Routed experts as grouped matrix products over tokens sorted by expert.

Every (token, choice) pair of the step is sorted by expert once; each expert then
multiplies one contiguous group of rows. `torch._grouped_mm` runs all groups in one
kernel with no host synchronisation (so a CUDA graph can capture it); where it cannot
run (an old torch, misaligned widths, a GPU without its kernels) a loop over the
groups does, reading the group sizes on the host once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# _grouped_mm wants 16-byte aligned rows.
_ALIGNMENT_BYTES = 16


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether `torch._grouped_mm` runs for these operands without a host sync."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    element = torch.empty(0, dtype=dtype).element_size()
    if any(dim * element % _ALIGNMENT_BYTES for dim in dims):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float32):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _grouped_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    group_ends: torch.Tensor,
    use_grouped_mm: bool,
) -> torch.Tensor:
    """rows [M, in] sorted by group; weight [E, out, in]; group e = rows[end_{e-1}:end_e]."""
    if use_grouped_mm:
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=group_ends)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = F.linear(rows[start:end], weight[expert])
        start = end
    return out


def experts_use_grouped_mm(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `grouped_expert_mlp` runs these weights in one sync-free kernel."""
    return grouped_mm_supported(w13.device, w13.dtype, *w13.shape[1:], *w2.shape[1:])


def grouped_expert_mlp(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    use_grouped_mm: bool,
) -> torch.Tensor:
    """sum_k routing_weights[:, k] * expert_{ids[:, k]}(x) as [N, D] fp32.

    x [N, D]; routing_weights, expert_ids [N, k]; w13 [E, 2I, D] (gate rows first);
    w2 [E, D, I]; `act` maps [M, 2I] to [M, I]; `use_grouped_mm` as
    `experts_use_grouped_mm` says for these weights.
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = w13.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    # A scatter, not bincount: CUDA's bincount reads its input's max on the host.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    group_ends = counts.cumsum(0, dtype=torch.int32)
    inner = act(_grouped_linear(x[token_of], w13, group_ends, use_grouped_mm))
    y = _grouped_linear(inner, w2, group_ends, use_grouped_mm).float()
    y = y * routing_weights.reshape(-1)[order].float().unsqueeze(1)
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add(0, token_of, y)
