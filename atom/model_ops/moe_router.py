"""Top-k expert selection (noaux_tc; docs/kimi_k3.md, MoE).

Sigmoid (or softmax) scores pick experts after adding the load-balancing correction
bias; the mixing weights are the unbiased scores. On CUDA one Triton program per token
does it all (`kernels/moe_routing.py`); this torch code is its reference.
"""

import torch

from atom.kernels import triton_available

_SCORINGS = ("sigmoid", "softmax")


def select_experts(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) for router_logits [T, E].

    With groups, a group's score is the sum of its two best choice scores and only
    the best `topk_group` groups stay eligible.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {router_logits.shape}")
    num_experts = router_logits.shape[1]
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring {scoring!r}; allowed: {', '.join(_SCORINGS)}")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"num_expert_group={num_expert_group} must divide {num_experts} experts"
        )
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, {num_expert_group}]")
    per_group = num_experts // num_expert_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(
            f"top_k={top_k} must be in [1, {topk_group * per_group}] "
            "(experts in the kept groups)"
        )
    if correction_bias is not None and correction_bias.numel() != num_experts:
        raise ValueError(
            f"correction_bias has {correction_bias.numel()} entries, "
            f"expected {num_experts}"
        )

    args = (
        router_logits,
        correction_bias,
        top_k,
        num_expert_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
        scoring,
    )
    if router_logits.is_cuda and triton_available(router_logits.device):
        from atom.kernels.moe_routing import select_experts_triton

        return select_experts_triton(*args)
    return select_experts_reference(*args)


def select_experts_reference(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    scoring: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in torch ops, for arguments it has validated."""
    num_experts = router_logits.shape[1]
    per_group = num_experts // num_expert_group
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores
    if correction_bias is not None:
        choice = scores + correction_bias.float().reshape(1, num_experts)
    if num_expert_group > 1 and topk_group < num_expert_group:
        grouped = choice.view(-1, num_expert_group, per_group)
        best_two = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        kept_groups = best_two.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(best_two, dtype=torch.bool)
        keep.scatter_(1, kept_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
