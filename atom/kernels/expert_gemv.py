"""The routed experts of a step with a token or two, in Triton, without sorting.

The torch reference is `atom.model_ops.grouped_experts.routed_mlp`: sort the
(token, choice) pairs by expert, run two grouped GEMMs and gather-sum the rows back.
At one token every pair has its own expert, so sorting buys nothing; the grouped
GEMM pads each pair to a 16-row tile and reads the experts at about 70 % of the
memory rate (H100, 2026-12-06), and the sort, the tile lists and the combine add
five launches a layer. Here each pair reads its expert's rows directly:

- `expert_up`: out[p] = x[p // k] W13[e_p]^T for every pair p (one launch);
- `expert_down_sum`: out[t] = sum_j weight[t, j] * h[t k + j] W2[e_tj]^T, the down
  product and the weighted sum in one launch, in fp32.

Both accumulate in fp32 with a broadcast multiply and a sum (`skinny_gemm.py`'s
form); the gated activation between them stays its own kernel. That form reads
large weights more slowly than the grouped GEMM does, so no step takes this path
yet (`grouped_experts.step_path`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels import multiprocessors
from atom.kernels.skinny_gemm import skinny_tiles


@triton.jit
def _expert_gemv_kernel(
    x_ptr,
    ids_ptr,
    route_ptr,
    w_ptr,
    out_ptr,
    n,
    k,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    CHOICES: tl.constexpr,
    SUM_CHOICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program axis 0: a pair (up) or a token (down, which sums its TOP_K pairs).
    owner = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < n
    total = tl.zeros((BLOCK_N,), tl.float32)
    for choice in range(CHOICES):  # TOP_K for down, 1 for up
        # Up reads its token's row; down reads the pair's own activated row.
        if SUM_CHOICES:
            pair = owner * TOP_K + choice
            row = pair
        else:
            pair = owner
            row = owner // TOP_K
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for start in range(0, k, BLOCK_K):
            kk = start + tl.arange(0, BLOCK_K)
            k_ok = kk < k
            w = tl.load(
                w_rows + kk[None, :], mask=cols_ok[:, None] & k_ok[None, :], other=0
            )
            x = tl.load(x_ptr + row * stride_x + kk, mask=k_ok, other=0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if SUM_CHOICES:
            total += tl.load(route_ptr + pair).to(tl.float32) * acc
        else:
            total = acc
    tl.store(
        out_ptr + owner * stride_out + cols,
        total.to(out_ptr.dtype.element_ty),
        mask=cols_ok,
    )


def _launch(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    owners: int,
) -> torch.Tensor:
    n, k = weight.shape[1], weight.shape[2]
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("expert weights and rows must be contiguous in their last dim")
    # Tiles as for one dense product of this width, spread over the owners' grid.
    tiles = skinny_tiles(1, n * owners, k, multiprocessors(x.device))
    top_k = expert_ids.shape[-1]
    _expert_gemv_kernel[(owners, triton.cdiv(n, tiles.block_n))](
        x,
        expert_ids,
        routing_weights if routing_weights is not None else x,
        weight,
        out,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        TOP_K=top_k,
        CHOICES=top_k if routing_weights is not None else 1,
        SUM_CHOICES=routing_weights is not None,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
    )
    return out


def expert_up(
    x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor
) -> torch.Tensor:
    """[T*k, 2I] in x's dtype: row t*k + j = x[t] W13[expert_ids[t, j]]^T.
    x [T, D], expert_ids [T, k] (contiguous), w13 [E, 2I, D]."""
    pairs = expert_ids.numel()
    out = torch.empty(pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    return _launch(x, expert_ids, None, w13, out, pairs)


def expert_down_sum(
    h: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """[T, D] fp32: sum_j routing_weights[t, j] * h[t*k + j] W2[expert_ids[t, j]]^T.
    h [T*k, I], expert_ids and routing_weights [T, k] (contiguous), w2 [E, D, I]."""
    tokens = expert_ids.shape[0]
    out = torch.empty(tokens, w2.shape[1], dtype=torch.float32, device=h.device)
    return _launch(h, expert_ids, routing_weights, w2, out, tokens)
