"""Expert selection in Triton: one program per token, the whole expert row in
registers.

The torch reference is `atom.model_ops.moe_router.select_experts_reference`, which
runs a dozen kernels per MoE layer (scores, bias, the group scores and their mask,
top-k, gather, sum, divide, scale). This reads the token's router logits once and writes its
k weights and expert ids once. Selection order is the reference's: descending by the
biased score, the lower expert id first among equals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _first_max(values, index):
    """(max, lowest index holding it) of a 1-D block: the reference's tie order."""
    best = tl.max(values, axis=0)
    at = tl.min(tl.where(values == best, index, values.shape[0]), axis=0)
    return best, at


@triton.jit
def select_token(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    token,
    num_experts,
    stride_logits,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Write one token's k weights and expert ids (`token` an int64 scalar)."""
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    logits = tl.load(
        logits_ptr + token * stride_logits + experts, mask=real, other=-float("inf")
    ).to(tl.float32)
    if SOFTMAX:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)
    choice = tl.where(real, choice, -float("inf"))
    if TOPK_GROUP < GROUPS:
        # A group scores the sum of its two best choices; only the best TOPK_GROUP
        # groups stay eligible.
        group_of = experts // PER_GROUP
        groups = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
        for g in tl.static_range(GROUPS):
            members = tl.where(group_of == g, choice, -float("inf"))
            top, at = _first_max(members, experts)
            if PER_GROUP > 1:
                second = tl.max(tl.where(experts == at, -float("inf"), members), axis=0)
                top += second
            group_score = tl.where(groups == g, top, group_score)
        kept = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, best = _first_max(group_score, groups)
            kept = kept | (group_of == best)
            group_score = tl.where(groups == best, -float("inf"), group_score)
        choice = tl.where(kept, choice, -float("inf"))
    # Blocks are powers of two: slots past TOP_K stay 0 and are never stored.
    picks = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.int32)
    picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        _, at = _first_max(choice, experts)
        weight = tl.sum(tl.where(experts == at, scores, 0.0), axis=0)
        chosen = tl.where(picks == slot, at, chosen)
        picked = tl.where(picks == slot, weight, picked)
        choice = tl.where(experts == at, -float("inf"), choice)
    if RENORMALIZE:
        picked = picked / (tl.sum(picked, axis=0) + 1e-20)
    real_pick = picks < TOP_K
    tl.store(
        weights_ptr + token * TOP_K + picks,
        picked * routed_scaling_factor,
        mask=real_pick,
    )
    tl.store(
        ids_ptr + token * TOP_K + picks,
        chosen.to(ids_ptr.dtype.element_ty),
        mask=real_pick,
    )


@triton.jit
def _select_experts_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    select_token(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        tl.program_id(0).to(tl.int64),
        num_experts,
        stride_logits,
        routed_scaling_factor,
        TOP_K,
        GROUPS,
        PER_GROUP,
        TOPK_GROUP,
        BLOCK_K,
        BLOCK_G,
        SOFTMAX,
        HAS_BIAS,
        RENORMALIZE,
        BLOCK_E,
    )


def selection_constants(
    num_experts: int,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    scoring: str,
    has_bias: bool,
) -> dict[str, object]:
    """`select_token`'s compile-time arguments for these routing settings."""
    # Masking whole groups only pays when some are dropped: one group otherwise.
    grouped = topk_group < num_expert_group
    groups = num_expert_group if grouped else 1
    return dict(
        TOP_K=top_k,
        GROUPS=groups,
        PER_GROUP=num_experts // groups,
        TOPK_GROUP=topk_group if grouped else 1,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(groups),
        SOFTMAX=scoring == "softmax",
        HAS_BIAS=has_bias,
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(num_experts),
    )


def select_experts_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64), as
    `moe_router.select_experts_reference` returns them, for arguments
    `moe_router.check_routing` passed."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(
        num_tokens, top_k, dtype=torch.float32, device=router_logits.device
    )
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.clone()
    _select_experts_kernel[(num_tokens,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        routed_scaling_factor,
        **selection_constants(
            num_experts,
            top_k,
            num_expert_group,
            topk_group,
            renormalize,
            scoring,
            correction_bias is not None,
        ),
    )
    return weights, ids
